"""One process of the colocated-engine check (tests/multihost/test_colocated_engine.py).

``python colocated_worker.py PROCESS_ID NUM_PROCESSES PORT MODEL_DIR OTHER_DIR TOKENIZER_DIR OUT_JSON [forever]``

With 2 processes: jax.distributed over 127.0.0.1:PORT, the backend from
``jaxrl.rollout.factory.colocated_backend`` (process 0 serves, process 1 repeats its calls).
With 1 process: the engine alone on ``colocated_mesh`` over this process's 8 devices. Either way
the same requests run on MODEL_DIR's weights, then on OTHER_DIR's (placed from a trainer-like
fsdp sharding over every device, as the RL loop hands them over), and process 0 writes every
completion's tokens and log-probs to OUT_JSON. ``forever`` (2 processes): process 0 serves the
requests again and again, touching OUT_JSON after the first round, until a process is killed.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

TENSOR_PARALLEL = 2


def requests() -> list:
    from jaxrl.engine.requests import Request
    from jaxrl.engine.token_sampling import SamplingParams

    rng = np.random.default_rng(0)
    shared = rng.integers(0, 265, 40).tolist()  # a prefix two requests share: row copies
    prompts = [shared + [5, 6], shared + [7], *(rng.integers(0, 265, int(n)).tolist() for n in (3, 70, 12, 33))]
    settings = [
        {"temperature": 0.0, "top_logprobs": 3},
        {"temperature": 1.0, "seed": 1},
        {"temperature": 0.7, "seed": 2, "top_k": 5},
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 4, "presence_penalty": 0.5},  # a token-count reset at admission
        {"temperature": 1.0, "seed": 5, "top_p": 0.9},
    ]
    return [Request(p, SamplingParams(max_tokens=12, **s)) for p, s in zip(prompts, settings)]


def trainer_like(model_dir: str):
    """The weights as a trainer holds them: split over every device (fsdp-like, dim 0 where it divides)."""
    from jaxrl.models.hf_io import load_decoder

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    n = len(jax.devices())

    def sharding(name: str, shape: tuple[int, ...]) -> NamedSharding:
        spec = PartitionSpec("fsdp") if shape and shape[0] % n == 0 else PartitionSpec()
        return NamedSharding(mesh, spec)

    return load_decoder(model_dir, sharding_fn=sharding)


def main() -> None:
    pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    model_dir, other_dir, tokenizer_dir, out = sys.argv[4:8]
    if nproc > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", nproc, pid)
    from flax import nnx

    from jaxrl.engine.engine import Engine
    from jaxrl.engine.weights import colocated_mesh
    from jaxrl.rollout.config import InferenceConfig

    inference = InferenceConfig.model_validate({
        "max_model_len": 128, "max_seqs": 4, "max_batched_tokens": 64,
        "backend": {"type": "embedded", "tensor_parallel": TENSOR_PARALLEL, "decode_steps": 3,
                    "decode_batch_buckets": [4], "prefill_len_buckets": [32], "prefill_batch_buckets": [2],
                    "min_prefix_reuse": 4, "colocated_timeout_s": 120},
    })  # fmt: skip
    model = trainer_like(model_dir)
    other = nnx.state(trainer_like(other_dir))
    results = []
    if nproc == 1:
        engine = Engine(model, inference.engine_config(), mesh=colocated_mesh(TENSOR_PARALLEL))
        results.append(engine.generate(requests()))
        engine.update_weights_from_state(other, version=1)
        results.append(engine.generate(requests()))
    else:
        from jaxrl.rollout.factory import colocated_backend

        backend = colocated_backend(
            model, inference, model_dir=None, served_name="tiny", tokenizer_dir=tokenizer_dir, renderer=None,
            return_routed_experts=False,
        )  # fmt: skip
        backend.start()
        if len(sys.argv) > 8 and sys.argv[8] == "forever":
            while True:
                if pid == 0:
                    backend.engine.generate(requests())
                    open(out, "w").close()
                else:
                    with backend.collective():  # repeats every call; process 0 never opens a section
                        pass
        try:
            if pid == 0:
                results.append(backend.engine.generate(requests()))
            with backend.collective():  # the RL loop's section: each process reshards the new weights
                backend.update_weights(other, version=1)
            if pid == 0:
                assert backend.policy_version == 1, backend.policy_version
                results.append(backend.engine.generate(requests()))
        finally:
            backend.stop()
        engine = backend.engine
    if pid == 0:
        rows = [[{"tokens": c.token_ids, "logprobs": c.logprobs, "versions": sorted(set(c.token_versions)),
                  "top": c.top_logprobs}
                 for c in batch] for batch in results]  # fmt: skip
        with open(out, "w") as f:
            json.dump({"runs": rows, "devices": len(engine.mesh.devices.flat)}, f)


if __name__ == "__main__":
    main()
