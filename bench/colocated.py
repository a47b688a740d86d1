"""What colocating the engine over processes costs per decode call (JSON lines).

Two processes x 4 CPU devices (jax.distributed on 127.0.0.1), one engine over all 8
(``colocated_mesh``), against the same engine in one process on 8 devices:

- ``channel``: process 0 sends a decode call's plan (batch ``--batch``: token ids, positions,
  rows, sampling settings) to process 1 the way the colocated engine does (pickled, one TCP
  connection, ``jaxrl.engine.lockstep``), and, for comparison, hands the same bytes over with
  ``multihost_utils.broadcast_one_to_all`` (a device program per call); microseconds per call,
  median of ``--calls``.
- ``engine``: seconds per decode device call of the engine serving ``--batch`` greedy requests
  (``decode_steps`` tokens each), colocated on 2 processes vs alone on 8 devices of one process.

    python bench/colocated.py [--batch 16] [--calls 400] [--tensor-parallel 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxrl.ports import free_port


def _plan(batch: int):
    import numpy as np

    from jaxrl.engine.scheduler import DecodePlan
    from jaxrl.engine.token_sampling import SamplingBatch, SamplingParams

    sampling = SamplingBatch.host([SamplingParams()] * batch, list(range(batch)), [10] * batch, batch)
    z = np.zeros(batch, np.int32)
    return DecodePlan([], z, z, z, sampling, 4, z, z)


def _engine_config(batch: int, tensor_parallel: int):
    from jaxrl.rollout.config import InferenceConfig

    return InferenceConfig.model_validate({
        "max_model_len": 256, "max_seqs": batch, "max_batched_tokens": 1024,
        "backend": {"type": "embedded", "tensor_parallel": tensor_parallel, "decode_steps": 4,
                    "decode_batch_buckets": [batch], "prefill_len_buckets": [64], "prefill_batch_buckets": [batch],
                    "colocated_timeout_s": 120},
    })  # fmt: skip


def _requests(batch: int) -> list:
    import numpy as np

    from jaxrl.engine.requests import Request
    from jaxrl.engine.token_sampling import SamplingParams

    rng = np.random.default_rng(0)
    return [Request(rng.integers(0, 256, 20).tolist(), SamplingParams(max_tokens=128, temperature=0.0)) for _ in range(batch)]


def _engine_seconds_per_decode(engine, batch: int) -> float:
    engine.generate(_requests(batch))  # compiles and warms
    before_s, before_n = engine.runner.device_s["decode"], engine.stats.decode_calls
    t0 = time.perf_counter()
    engine.generate(_requests(batch))
    wall = time.perf_counter() - t0
    calls = engine.stats.decode_calls - before_n
    return wall / calls, (engine.runner.device_s["decode"] - before_s) / calls


def worker(pid: int, nproc: int, port: int, model_dir: str, a: argparse.Namespace, out: str) -> None:
    batch, calls = a.batch, a.calls
    import jax

    if nproc > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", nproc, pid)
    from jaxrl.engine.engine import Engine
    from jaxrl.engine.weights import colocated_mesh, param_sharding_fn
    from jaxrl.models.hf_io import load_decoder

    inference = _engine_config(batch, a.tensor_parallel)
    mesh = colocated_mesh(a.tensor_parallel)
    model = load_decoder(model_dir, sharding_fn=param_sharding_fn(mesh))
    result: dict = {}
    if nproc == 1:
        engine = Engine(model, inference.engine_config(), mesh=mesh)
        wall, device = _engine_seconds_per_decode(engine, batch)
        result = {"one_process_s_per_decode_call": wall, "one_process_device_s_per_decode_call": device}
    else:
        import numpy as np
        from jax.experimental import multihost_utils

        from jaxrl.engine.lockstep import SYNC
        from jaxrl.rollout.factory import colocated_backend

        backend = colocated_backend(model, inference, model_dir=None, served_name="b", tokenizer_dir=f"{model_dir}-tok", renderer=None,
                                  return_routed_experts=False)  # fmt: skip
        backend.start()
        plan = _plan(batch)
        payload = pickle.dumps(("decode", (plan,)), protocol=pickle.HIGHEST_PROTOCOL)
        # the socket, as the engine uses it: process 0 sends, process 1 receives (then a SYNC)
        if pid == 0:
            leader = backend.leader
            t0 = time.perf_counter()
            for _ in range(calls):
                leader.send("ping")  # heartbeats are skipped by the receiver: only the transport is timed
            send_s = (time.perf_counter() - t0) / calls
            sends = []
            for _ in range(calls):
                t = time.perf_counter()
                leader.send("probe", plan)
                sends.append(time.perf_counter() - t)
            leader.send(SYNC)
        else:
            follower = backend.replica.follower
            recvs = []
            for _ in range(calls):
                t = time.perf_counter()
                name, _args = follower.receive()
                recvs.append(time.perf_counter() - t)
                assert name == "probe"
            assert follower.receive()[0] == SYNC
        # broadcast_one_to_all of the same bytes: one device program per call, every process in it
        data = np.frombuffer(payload, np.uint8)
        multihost_utils.broadcast_one_to_all(data)  # compile
        times = []
        for _ in range(calls // 4):
            t = time.perf_counter()
            multihost_utils.broadcast_one_to_all(data if pid == 0 else np.zeros_like(data))
            times.append(time.perf_counter() - t)
        # the engine itself, colocated: process 0 serves, process 1 repeats (a section ends it)
        if pid == 0:
            wall, device = _engine_seconds_per_decode(backend.engine, batch)
            with backend.collective():
                pass
            result = {
                "plan_bytes": len(payload), "socket_send_us": statistics.median(sends) * 1e6,
                "socket_ping_send_us": send_s * 1e6,
                "broadcast_one_to_all_us": statistics.median(times) * 1e6,
                "colocated_s_per_decode_call": wall, "colocated_device_s_per_decode_call": device,
            }
        else:
            with backend.collective():
                pass
            result = {"socket_receive_us": statistics.median(recvs) * 1e6}
        backend.stop()
    Path(out).write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--tensor-parallel", type=int, default=2, help="the engine's tensor axis (data = 8 / it)")
    p.add_argument("--worker", nargs=5, default=None)
    a = p.parse_args()
    if a.worker:
        pid, nproc, port, model_dir, out = a.worker
        worker(int(pid), int(nproc), int(port), model_dir, a, out)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_qwen3 import save_tiny_qwen3

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        params = save_tiny_qwen3(model, vocab=512, hidden=128, layers=4, max_len=512)
        from jaxrl.models.tokenizer import build_tokenizer

        build_tokenizer(Path(f"{model}-tok"))
        port = free_port()
        def run(pid: int, nproc: int) -> subprocess.Popen:
            env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // nproc}")
            args = [sys.executable, __file__, "--batch", str(a.batch), "--calls", str(a.calls),
                    "--tensor-parallel", str(a.tensor_parallel), "--worker",
                    str(pid), str(nproc), str(port), str(model), f"{tmp}/{nproc}-{pid}.json"]
            return subprocess.Popen(args, env=env, stderr=subprocess.DEVNULL)

        assert run(0, 1).wait() == 0
        procs = [run(i, 2) for i in range(2)]
        assert [q.wait() for q in procs] == [0, 0]
        merged = {"bench": "colocated", "params": params, "batch": a.batch, "calls": a.calls,
                  "tensor_parallel": a.tensor_parallel}
        for name in ("1-0", "2-0", "2-1"):
            merged |= json.loads(Path(f"{tmp}/{name}.json").read_text())
    merged["colocated_vs_one_process"] = merged["colocated_s_per_decode_call"] / merged["one_process_s_per_decode_call"]
    print(json.dumps(merged))


if __name__ == "__main__":
    main()
