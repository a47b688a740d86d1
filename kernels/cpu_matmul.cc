// Small-batch matmul for XLA:CPU decode steps, as an XLA FFI custom call: out = x @ w[layer]
// with x [M, K] and out [M, N] float32 row-major, and w a stack of L matrices [K, N] float32,
// each pre-packed into column panels: [L, ceil(N / 32), K, 32] (zero-padded;
// kernels/cpu_matmul.py packs them once per weight update). The kernel reads layer `layer` of
// the stack in place, so a layer scan hands it the whole stack: XLA:CPU would copy a sliced
// layer out of the stack before every call.
//
// Why C++ and not XLA: a decode step multiplies a few dozen rows (one per sequence) by every
// weight matrix, and XLA:CPU runs those dots at a third of what the cores can do (measured on a
// 2-core host, x [32, 256] @ w [256, 1536]: XLA 76-99 GFLOP/s, torch/MKL 264-299 on two
// threads; XLA flags for its other dot back-ends change nothing). vLLM's CPU backend calls
// oneDNN, with pre-packed weights, for the same reason. kernels/cpu_matmul.py builds and
// registers this file; ``x @ w`` is the definition of the semantics and the tests compare them.
//
// How: XLA's intra-op thread pool takes work items (a panel, and a block of rows) off a shared
// counter. Per item, tiles of kMr rows keep kMr x 32 results in registers (16 accumulators of 16
// floats) while walking K: per k, two loads of the panel, kMr broadcasts of x and 2 * kMr fused
// multiply-adds. A packed panel is one contiguous K x 32 block, read front to back (rows of a
// plain [K, N] matrix are N floats apart: for N >= 1024 every k is a new page, which the
// hardware prefetcher does not follow; one thread measured 50 GFLOP/s unpacked at
// [32, 1024] @ [1024, 3072]). Every output element is summed in the same order whichever
// thread computes it, so results do not depend on the thread count or timing. Written with
// GCC/Clang vector extensions: -march=native picks the widest FMA the host has.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float V16 __attribute__((vector_size(64)));

constexpr int64_t kMr = 8;              // rows per register tile
constexpr int64_t kNr = 32;             // columns per panel (two vectors)
constexpr int64_t kItemsPerThread = 4;  // work items per thread, for balance

inline V16 Load(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, V16 v) { std::memcpy(p, &v, sizeof v); }

// out[0:MR, 0:n] = x[0:MR, :] @ panel (K x kNr), n <= kNr; row strides K (x) and N (out).
template <int64_t MR>
inline void Tile(const float* x, const float* panel, float* out, int64_t K, int64_t N, int64_t n) {
  V16 c0[MR], c1[MR];
  for (int64_t i = 0; i < MR; ++i) c0[i] = c1[i] = V16{};
  for (int64_t k = 0; k < K; ++k) {
    const V16 b0 = Load(panel + k * kNr), b1 = Load(panel + k * kNr + 16);
    for (int64_t i = 0; i < MR; ++i) {
      const float a = x[i * K + k];
      c0[i] += a * b0;
      c1[i] += a * b1;
    }
  }
  for (int64_t i = 0; i < MR; ++i) {
    if (n == kNr) {
      Store(out + i * N, c0[i]);
      Store(out + i * N + 16, c1[i]);
    } else {  // the last panel: its zero padding is not written
      float tmp[kNr];
      Store(tmp, c0[i]);
      Store(tmp + 16, c1[i]);
      std::memcpy(out + i * N, tmp, n * sizeof(float));
    }
  }
}

// Rows [0, m) of x times one panel, into the panel's n columns of out.
void Item(const float* x, const float* panel, float* out, int64_t m, int64_t K, int64_t N, int64_t n) {
  int64_t i = 0;
  for (; i + kMr <= m; i += kMr) Tile<kMr>(x + i * K, panel, out + i * N, K, N, n);
  const float* xr = x + i * K;
  float* o = out + i * N;
  switch (m - i) {
    case 7: return Tile<7>(xr, panel, o, K, N, n);
    case 6: return Tile<6>(xr, panel, o, K, N, n);
    case 5: return Tile<5>(xr, panel, o, K, N, n);
    case 4: return Tile<4>(xr, panel, o, K, N, n);
    case 3: return Tile<3>(xr, panel, o, K, N, n);
    case 2: return Tile<2>(xr, panel, o, K, N, n);
    case 1: return Tile<1>(xr, panel, o, K, N, n);
    default: return;
  }
}

// Shared by the calling thread and the tasks it schedules; tasks that start after the work
// is gone find nothing to do (they hold their own reference, so returning early is safe).
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || od.size() != 2 || wd[3] != kNr || xd[1] != wd[2] ||
      od[0] != xd[0] || od[1] > wd[1] * kNr || od[1] <= (wd[1] - 1) * kNr)
    return ffi::Error::InvalidArgument("x must be [M, K], w packed [L, ceil(N / 32), K, 32], out [M, N]");
  const int64_t M = xd[0], K = xd[1], N = od[1], panels = wd[1];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data() + l * panels * K * kNr;
  float* op = out->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  // Items are (panel, block of rows): whole panels where there are enough of them (each
  // panel is then read once), else panels cut into row blocks (multiples of kMr) so every
  // thread gets kItemsPerThread items.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t tiles = (M + kMr - 1) / kMr;
  const int64_t cuts = std::clamp<int64_t>((kItemsPerThread * threads + panels - 1) / panels, 1, tiles);
  const int64_t rows = (tiles + cuts - 1) / cuts * kMr;
  const int64_t blocks = (M + rows - 1) / rows;
  auto work = std::make_shared<Work>();
  work->total = panels * blocks;
  auto drain = [=]() {
    for (int64_t item; (item = work->next.fetch_add(1)) < work->total;) {
      const int64_t p = item / blocks, i0 = item % blocks * rows;
      const int64_t n = std::min(kNr, N - p * kNr);
      Item(xp + i0 * K, wp + p * K * kNr, op + i0 * N + p * kNr, std::min(rows, M - i0), K, N, n);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(threads, work->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = drain;  // Schedule takes its task by value
    pool.Schedule(std::move(task));
  }
  drain();
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlCpuMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
