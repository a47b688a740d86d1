// Attention over the engine's KV cache (decode steps and prefill chunks) for XLA:CPU, as an XLA FFI
// custom call.
//
// Why C++ and not XLA: XLA:CPU cannot feed a dot from a slice of the cache in place, so the
// pure-JAX reference (jaxrl.models.decoder.cached_attention) copies each chunk of cache rows out
// (a gather), then multiplies it: about three passes over the KV bytes where this makes one.
// Decode attention is memory-bound, so that is most of its cost (measured, 32 rows at ~500
// positions: 24 ms of a 26 ms decode step). vLLM's CPU backend has C++ kernels for the same
// reason. kernels/cpu_cached_attention.py builds and registers this file; the reference stays
// the definition of the semantics, and the tests compare the two.
//
// Semantics (those of cached_attention): query b, t (q [B, T, H, D], float32) at position
// positions[b, t] attends to positions 0..positions[b, t] of cache row rows[b] of `layer` in the
// caches [L, R, K, S, D] (float32 or bfloat16), kv head h / (H / K) (grouped queries). Rows out
// of [0, R) and positions out of [0, S) are padding: their outputs are zeros (the caller drops
// them). Work is split over (b, kv head) items on XLA's intra-op thread pool; each item reads
// its row's keys and values once, for all its H / K * T queries, in blocks of kBlock positions
// with an online softmax.
//
// Shared prefixes (share_rows [B], share_lens [B]): the engine tells which rows hold the same
// keys and values as another row over their first positions (a GRPO group's prompt, an env's
// system prompt and tool specs: copies of one prefill). Positions < share_lens[b] of row rows[b]
// are then read from row share_rows[b] instead: the same values, so the same result bit for bit,
// but one copy read by every row of the batch stays in the core's L2 where separate copies
// stream from memory (measured, 32 rows x 900 positions, one core: 16 -> 7 ms per step).
// share_lens[b] <= 0 or a share row out of range: no redirect.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Dims {
  int64_t B, T, H, D, L, R, K, S, G;
};

inline float Bf16ToF32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A cache vector of D values as float32 (a pointer into the cache when it already is).
inline const float* AsF32(const float* p, int64_t, float*) { return p; }
inline const float* AsF32(const uint16_t* p, int64_t d, float* tmp) {
  for (int64_t i = 0; i < d; ++i) tmp[i] = Bf16ToF32(p[i]);
  return tmp;
}

// exp(x) for the softmax (x <= 0 here), written so the compiler vectorises the loops that
// call it (std::exp is a scalar libm call; glibc's vector exp needs -ffast-math, which would
// also drop the -inf handling). 2^(x log2 e) = 2^i * 2^f with a degree-6 polynomial for 2^f on
// [0, 1): relative error < 2e-7; inputs below -87 (masked scores are -inf) give 0.
inline float SoftmaxExp(float x) {
  const float t = std::max(x, -87.f) * 1.44269504088896341f;
  const float i = std::floor(t);
  const float f = t - i;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
}

inline float Dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// Four dot products of q with four keys at once: four independent accumulator chains, so the
// FMA latency and the final horizontal sums overlap (one Dot at a time is latency-bound).
inline void Dot4(const float* q, const float* const* keys, int64_t d, float* out) {
  const float *k0 = keys[0], *k1 = keys[1], *k2 = keys[2], *k3 = keys[3];
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < d; ++i) {
    s0 += q[i] * k0[i];
    s1 += q[i] * k1[i];
    s2 += q[i] * k2[i];
    s3 += q[i] * k3[i];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// y += sum_i p[i] * x[i] over `len` value vectors: four at a time, summed in a tree before
// touching y, so the accumulator's load-FMA-store chain is paid once per four keys.
inline void AxpyBlock(const float* p, const float* const* x, int64_t len, float* y, int64_t d) {
  int64_t i = 0;
  for (; i + 4 <= len; i += 4) {
    const float p0 = p[i], p1 = p[i + 1], p2 = p[i + 2], p3 = p[i + 3];
    const float *x0 = x[i], *x1 = x[i + 1], *x2 = x[i + 2], *x3 = x[i + 3];
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) y[e] += (p0 * x0[e] + p1 * x1[e]) + (p2 * x2[e] + p3 * x3[e]);
  }
  for (; i < len; ++i) {
    const float pi = p[i];
    const float* xi = x[i];
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) y[e] += pi * xi[e];
  }
}

struct Scratch {
  std::vector<float> q, acc, m, l, scores, keys, values;  // keys/values: a bf16 block as f32
  std::vector<int64_t> qpos;
  void Resize(int64_t n, int64_t d) {
    q.resize(n * d);
    acc.assign(n * d, 0.f);
    m.assign(n, kNegInf);
    l.assign(n, 0.f);
    scores.resize(n * kBlock);
    keys.resize(kBlock * d);
    values.resize(kBlock * d);
    qpos.resize(n);
  }
};

// Attention of the T * G queries of (row b, kv head k).
template <typename T>
void AttendItem(const Dims& d, const float* q, const T* kc, const T* vc, int64_t layer,
                const int32_t* rows, const int32_t* positions, const int32_t* share_rows,
                const int32_t* share_lens, float* out, int64_t item, Scratch& s) {
  const int64_t b = item / d.K, k = item % d.K, n = d.T * d.G, D = d.D;
  auto out_of = [&](int64_t j) {  // output vector of query j = t * G + g
    const int64_t t = j / d.G, h = k * d.G + j % d.G;
    return out + ((b * d.T + t) * d.H + h) * D;
  };
  for (int64_t j = 0; j < n; ++j) std::memset(out_of(j), 0, D * sizeof(float));
  const int64_t row = rows[b];
  if (row < 0 || row >= d.R) return;

  s.Resize(n, D);
  int64_t furthest = -1;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = j / d.G, h = k * d.G + j % d.G;
    const int64_t p = positions[b * d.T + t];
    s.qpos[j] = (p >= 0 && p < d.S) ? p : -1;
    furthest = std::max(furthest, s.qpos[j]);
    const float* src = q + ((b * d.T + t) * d.H + h) * D;
    for (int64_t i = 0; i < D; ++i) s.q[j * D + i] = src[i] * scale;
  }
  if (furthest < 0) return;

  const int64_t base = ((layer * d.R + row) * d.K + k) * d.S * D;
  const int64_t share_row = share_rows[b];
  const bool shares = share_row >= 0 && share_row < d.R;
  const int64_t shared = shares ? std::min<int64_t>(share_lens[b], d.S) : 0;
  const int64_t shared_base = ((layer * d.R + (shares ? share_row : row)) * d.K + k) * d.S * D;
  // Key or value vector of position p: from the share row below `shared`, else from our row.
  auto at = [&](const T* cache, int64_t p) { return cache + (p < shared ? shared_base : base) + p * D; };
  const float* kp[kBlock];  // this block's key and value vectors, as float32
  const float* vp[kBlock];
  for (int64_t s0 = 0; s0 <= furthest; s0 += kBlock) {
    const int64_t len = std::min(kBlock, furthest + 1 - s0);
    for (int64_t i = 0; i < len; ++i) {
      kp[i] = AsF32(at(kc, s0 + i), D, &s.keys[i * D]);
      vp[i] = AsF32(at(vc, s0 + i), D, &s.values[i * D]);
    }
    for (int64_t j = 0; j < n; ++j) {  // scores (the block's keys stay in L1 across queries)
      if (s.qpos[j] < s0) continue;
      float* sc = &s.scores[j * kBlock];
      const float* qj = &s.q[j * D];
      int64_t i = 0;
      for (; i + 4 <= len; i += 4) Dot4(qj, &kp[i], D, &sc[i]);
      for (; i < len; ++i) sc[i] = Dot(qj, kp[i], D);
      for (i = std::max<int64_t>(s.qpos[j] + 1 - s0, 0); i < len; ++i) sc[i] = kNegInf;  // causal mask
    }
    for (int64_t j = 0; j < n; ++j) {  // online softmax: rescale, then exponentiate in place
      if (s.qpos[j] < s0) continue;
      float* sc = &s.scores[j * kBlock];
      float block_max = kNegInf;
      for (int64_t i = 0; i < len; ++i) block_max = std::max(block_max, sc[i]);
      const float m_new = std::max(s.m[j], block_max);
      const float correction = SoftmaxExp(s.m[j] - m_new);  // 0 on the first block (m = -inf)
      float total = s.l[j] * correction;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < len; ++i) {
        sc[i] = SoftmaxExp(sc[i] - m_new);  // masked: exp(-inf) = 0
        total += sc[i];
      }
      if (correction != 1.f) {
        float* a = &s.acc[j * D];
        for (int64_t i = 0; i < D; ++i) a[i] *= correction;
      }
      s.m[j] = m_new;
      s.l[j] = total;
      // values up to the query's position (masked weights beyond it are 0: skip them)
      AxpyBlock(sc, vp, std::min(len, s.qpos[j] + 1 - s0), &s.acc[j * D], D);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    if (s.qpos[j] < 0) continue;
    const float inv = 1.f / s.l[j];
    float* o = out_of(j);
    for (int64_t i = 0; i < D; ++i) o[i] = s.acc[j * D + i] * inv;
  }
}

// Shared by the calling thread and the tasks it schedules; tasks that start after the work
// is gone find nothing to do (they hold their own reference, so returning early is safe).
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

template <typename T>
void Run(ffi::ThreadPool& pool, const Dims& d, const float* q, const T* kc, const T* vc,
         int64_t layer, const int32_t* rows, const int32_t* positions, const int32_t* share_rows,
         const int32_t* share_lens, float* out) {
  auto work = std::make_shared<Work>();
  work->total = d.B * d.K;
  auto drain = [=]() {
    thread_local Scratch scratch;
    for (int64_t i; (i = work->next.fetch_add(1)) < work->total;) {
      AttendItem<T>(d, q, kc, vc, layer, rows, positions, share_rows, share_lens, out, i, scratch);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = drain;  // Schedule takes its task by value
    pool.Schedule(std::move(task));
  }
  drain();
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kc,
                ffi::AnyBuffer vc, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> share_rows,
                ffi::Buffer<ffi::S32> share_lens, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto cd = kc.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || vc.dimensions().size() != 5)
    return ffi::Error::InvalidArgument("q must be [B, T, H, D] and the caches [L, R, K, S, D]");
  Dims d{qd[0], qd[1], qd[2], qd[3], cd[0], cd[1], cd[2], cd[3], 0};
  if (cd[4] != d.D || d.K == 0 || d.H % d.K != 0)
    return ffi::Error::InvalidArgument("head_dim or head counts of q and the caches disagree");
  if (kc.element_type() != vc.element_type())
    return ffi::Error::InvalidArgument("the key and value caches have different dtypes");
  d.G = d.H / d.K;
  if (rows.element_count() != d.B || positions.element_count() != d.B * d.T ||
      share_rows.element_count() != d.B || share_lens.element_count() != d.B)
    return ffi::Error::InvalidArgument("rows, share_rows, share_lens must be [B] and positions [B, T]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= d.L) return ffi::Error::InvalidArgument("layer out of range");
  float* o = out->typed_data();
  switch (kc.element_type()) {
    case ffi::F32:
      Run<float>(pool, d, q.typed_data(), static_cast<const float*>(kc.untyped_data()),
                 static_cast<const float*>(vc.untyped_data()), l, rows.typed_data(),
                 positions.typed_data(), share_rows.typed_data(), share_lens.typed_data(), o);
      return ffi::Error::Success();
    case ffi::BF16:
      Run<uint16_t>(pool, d, q.typed_data(), static_cast<const uint16_t*>(kc.untyped_data()),
                    static_cast<const uint16_t*>(vc.untyped_data()), l, rows.typed_data(),
                    positions.typed_data(), share_rows.typed_data(), share_lens.typed_data(), o);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("KV cache dtype must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlCpuCachedAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
