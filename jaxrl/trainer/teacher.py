"""A frozen teacher on the trainer's mesh that scores samples for the ref-KL component (OPD).

The teacher reads each sample exactly as the trainer will (same packing, same per-token
temperature, same kernels) and writes its log-prob of every token into `sample.logr`, so the
ref-KL term compares the two models on identical tempered distributions. Samples are packed
into the trainer's row buckets and scored one micro-batch at a time under one jitted forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxrl.models.decoder import Decoder
from jaxrl.models.hf_io import load_decoder
from jaxrl.models.hub import resolve_model_dir
from jaxrl.models.sharding import param_sharding_fn
from jaxrl.parallel.mesh import batch_sharding
from jaxrl.trainer.packing import assign_rows
from jaxrl.trainer.step import Trainer, packed_logprobs
from jaxrl.training_sample import TrainingSample

_FIELDS = ("tokens", "positions", "segment_ids", "temperature")


class Teacher:
    """Scores samples with a frozen model sharded like the trainer's policy."""

    def __init__(self, model: Decoder, trainer: Trainer) -> None:
        if model.arch.vocab_size != trainer.arch.vocab_size:
            raise ValueError(
                f"teacher vocabulary ({model.arch.vocab_size}) differs from the policy's "
                f"({trainer.arch.vocab_size}): on-policy distillation needs one tokenizer for both"
            )
        self.trainer = trainer
        graphdef, self.params = nnx.split(model)
        kernels, block = trainer.kernels, trainer.cfg.vocab_block
        self._score = jax.jit(lambda params, mb: packed_logprobs(nnx.merge(graphdef, params), mb, kernels, block)[0])

    @classmethod
    def load(cls, name: str, trainer: Trainer, dtype: str = "float32") -> Teacher:
        dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
        model = load_decoder(resolve_model_dir(name), param_dtype=dt, dtype=dt, sharding_fn=param_sharding_fn(trainer.mesh))
        return cls(model, trainer)

    def score(self, samples: Sequence[TrainingSample]) -> None:
        """Set `logr` of every sample: the teacher's log-prob of each token (0 at the first,
        which has no prediction)."""
        if not samples:
            return
        batch = self.trainer.pack(samples)
        seq_len, rows = batch.tokens.shape[1], self.trainer.cfg.micro_batch_rows
        sharding = batch_sharding(self.trainer.mesh)
        logr = np.zeros(batch.tokens.shape, np.float32)
        for start in range(0, batch.num_rows, rows):
            mb = batch.rows(start, start + rows).as_dict()
            mb = {k: jax.make_array_from_callback(mb[k].shape, sharding, lambda i, v=mb[k]: v[i]) for k in _FIELDS}
            scored = multihost_utils.process_allgather(self._score(self.params, mb), tiled=True)
            logr[start : start + rows, 1:] = np.asarray(scored)
        for r, members in enumerate(assign_rows([len(s) for s in samples], seq_len)):
            offset = 0
            for i in members:
                n = len(samples[i])
                samples[i].logr = np.concatenate([[0.0], logr[r, offset + 1 : offset + n]]).astype(np.float32)
                offset += n
