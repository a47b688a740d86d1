"""The embedded engine's config, in two parts that live in two places of a run's config:

- ``SharedSettings``: what every rollout backend reads, so ``[inference]`` itself holds them
  (``max_model_len``, ``max_seqs``, ``max_batched_tokens``, ``weight_update``, ``seed``; a vLLM
  server gets them as its flags);
- ``EngineSettings``: what only this engine reads (compiled shapes, kernels, parallelism,
  warm-up, prefix reuse), the fields of ``[inference.backend]`` with ``type = "embedded"``
  (``jaxrl.rollout.config.EmbeddedConfig``).

``EngineConfig`` is both: the one object the engine takes (``InferenceConfig.engine_config()``
builds it from a run's config). Every shape the engine compiles is decided here: the KV cache is
``max_seqs`` rows of ``max_model_len`` positions, and each device program is compiled for one
bucket of batch size and length, so a run compiles a bounded, predictable number of programs
(see ``EngineConfig.program_bound``). Lists left unset are derived from the sizes.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxrl.kernel_dispatch import KernelChoice
from jaxrl.sampling_contract import MAX_LOGPROBS


def _powers_of_two(lo: int, hi: int, factor: int = 2) -> list[int]:
    """Powers of ``factor`` from ``lo`` up to ``hi``, with ``hi`` itself always last."""
    out, b = [], 1
    while b < hi:
        if b >= lo:
            out.append(b)
        b *= factor
    return [*out, hi]


class SharedSettings(BaseModel):
    """The settings every rollout backend reads (embedded, vLLM, external servers): the fields of
    ``[inference]`` itself."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt + completion, in tokens. Also the KV cache row length. Default: the model's
    own context length (``max_position_embeddings``), as vLLM does; set it lower to save memory."""

    max_seqs: int = Field(32, ge=1)
    """Sequences decoded concurrently (KV cache rows). Finished rows stay cached for prefix reuse
    until a new sequence needs the row."""

    max_batched_tokens: int = Field(2048, ge=1)
    """Tokens processed per engine step (prefill tokens, padding included, plus one per decoding
    sequence); long prompts are prefilled in chunks across steps."""

    weight_update: Literal["drain", "immediate"] = "drain"
    """When new weights take effect. "drain": admission pauses, requests in flight finish on the
    old weights, then the swap happens (no request ever mixes two policies). "immediate": the swap
    happens between two engine steps and requests in flight continue on the new weights (their
    responses report the version of every token: ``token_versions``). vLLM servers (launched or
    external) pause the same way: ``/pause?mode=wait`` for "drain", ``mode=keep`` for "immediate"."""

    seed: int = 0
    """Seeds the sampling of requests that carry no seed of their own (vLLM: ``--seed``)."""

    def with_model_len(self, context_len: int) -> Self:
        """This config with ``max_model_len`` defaulted to a model's context length (validated;
        of the same class: the ``[inference]`` section keeps its backend and server)."""
        if self.max_model_len is not None:
            return self
        return type(self).model_validate({**self.model_dump(), "max_model_len": context_len})


class EngineSettings(BaseModel):
    """The settings only the embedded engine reads: ``[inference.backend]`` with ``type =
    "embedded"`` (a vLLM or external backend refuses them)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    decode_steps: int = Field(4, ge=1)
    """Decode steps run on device per engine step while requests wait to join (queued, or
    prefilling). Requests join and leave between engine steps; more steps amortise per-call
    overhead but a finished sequence may compute up to ``decode_steps - 1`` discarded tokens."""

    decode_steps_idle: int | None = Field(None, ge=1)
    """Decode steps per engine step when no request waits to join and some running sequence
    still needs that many tokens: nothing is delayed by a longer call, and each call's fixed
    cost (dispatch, reading tokens back, host bookkeeping) is spread over more tokens
    (measured: +20% tokens/s at batch 32 with 16 vs 4 on a 5M model on CPU). Unset (default):
    ``decode_steps``, i.e. off. Setting it doubles the decode programs the warm-up compiles; RL
    runs with more requests than ``max_seqs`` rarely have an empty queue, so it pays off mostly
    when serving."""

    decode_batch_buckets: list[int] | None = None
    """Batch sizes decode is compiled for; default: 1, then powers of two from 8 up to
    ``max_seqs`` (decode reads every weight once per step whatever the batch, so 2-7 rows cost
    about what 8 do: those buckets would only add compiles; a TPU pads them to 8 anyway)."""

    prefill_len_buckets: list[int] | None = None
    """Prompt-chunk lengths prefill is compiled for; the largest is the prefill chunk size.
    Default: powers of four from 16 up to min(512, ``max_model_len``) (fewer programs to compile
    at start-up; prefix reuse leaves short prefills in RL, where padding costs little)."""

    prefill_batch_buckets: list[int] | None = None
    """Numbers of prompts prefilled together; default: powers of two up to min(8, ``max_seqs``)."""

    tensor_parallel: int = Field(1, ge=1)
    """Devices the embedded engine shards weights and KV cache over (heads, MLP and vocabulary
    split along a "tensor" mesh axis made of the first N devices)."""

    expert_parallel: int = Field(1, ge=1)
    """Devices a mixture-of-experts model's experts are split over (an "expert" mesh axis; each
    device holds num_experts / expert_parallel of them and computes their share of every token,
    summed over the axis). The engine's mesh is expert_parallel x tensor_parallel devices; the
    experts must divide by it (checked at load)."""

    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """KV cache dtype; "auto" uses the model's compute dtype (``[model] dtype``)."""

    quantization: Literal["none", "int8", "fp8"] = "none"
    """Serve the attention and MLP projections in 8 bits, one scale per output channel,
    quantized on device whenever weights are placed or swapped in (the trainer keeps its own
    precision) and dequantized inside each program (``jaxrl.models.quantize``): half the weight
    bytes a bf16 decode step reads, and room for KV cache. Sampled tokens' log-probs then differ
    more from the trainer's: pair it with an off-policy correction (``[trainer.loss]`` TIS /
    MIS / IcePop; docs/quantization.md). "int8": round to nearest over 255 levels; "fp8":
    float8_e4m3fn (H100 / H200 and TPU v5p+ carry it natively)."""

    kernels: KernelChoice = "auto"
    """Decode attention over the KV cache, and on CPU the projections (``jaxrl.kernel_dispatch``).
    "auto": the Pallas kernel on TPU; on CPU the CPU serving backend (``kernels/cpu_serving.py``:
    ``kernels/cpu_cached_attention.cc`` and, on one device in float32, ``kernels/cpu_matmul.cc``
    on weights packed once per update; built once per machine, the references where no C++
    compiler is found); the pure-JAX reference elsewhere (GPU included: ``jaxrl.kernel_dispatch``
    says why). "reference" /
    "pallas": always that one ("pallas" on a backend without the kernel fails at start-up).
    "pallas_interpret": the kernel in Pallas interpret mode on any backend (slow; for tests)."""

    warmup: bool = True
    """Compile every device program (``program_bound()`` of them) when the HTTP server starts,
    before ``GET /health`` answers: no rollout then waits on a compile. The time is printed and
    reported as ``warmup_s`` in ``GET /metrics.json`` (``jaxrl:warmup_seconds`` in ``GET /metrics``). Off: programs compile on first use."""

    max_logprobs: int = Field(MAX_LOGPROBS, ge=0, le=MAX_LOGPROBS)
    """Most ``top_logprobs`` (chat) or ``logprobs`` (completions) a request may ask for (vLLM's
    ``--max-logprobs``, default 20); more is a 400 naming the field. Every program outputs this
    many top log-probs per token, computed only in batches where some request asks (0: never)."""

    min_prefix_reuse: int = Field(16, ge=1)
    """Shortest shared prefix worth copying from another sequence's cache row (a row left by the
    same conversation, or with the same ``X-Session-ID``, is reused at any length)."""

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "decode_len_buckets" in data:
            raise ValueError(
                "inference.backend.decode_len_buckets was removed: decode attention now reads as far as each "
                "batch's longest sequence, with no program per length; delete the key"
            )
        return data

    @model_validator(mode="after")
    def _buckets(self) -> EngineSettings:
        for name in ("decode_batch_buckets", "prefill_len_buckets", "prefill_batch_buckets"):
            buckets = getattr(self, name)
            if buckets is not None and (not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1):
                raise ValueError(
                    f"inference.backend.{name} must be a strictly increasing list of positive ints, got {buckets}"
                )
        if self.decode_steps_idle is not None and self.decode_steps_idle < self.decode_steps:
            raise ValueError(
                f"inference.backend.decode_steps_idle ({self.decode_steps_idle}) must be >= decode_steps "
                f"({self.decode_steps})"
            )
        return self


class EngineConfig(SharedSettings, EngineSettings):
    """The embedded engine's whole config: ``[inference]``'s shared settings with the embedded
    backend's own (``InferenceConfig.engine_config()``), checked together: the buckets cover
    ``max_seqs`` and the prefill chunk fits ``max_batched_tokens``."""

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        self.check_shapes()
        return self

    def check_shapes(self) -> None:
        """What the two parts decide together (raises ValueError naming the fields)."""
        if self.decode_buckets()[-1] < self.max_seqs:
            raise ValueError(
                f"inference.backend.decode_batch_buckets: largest bucket {self.decode_buckets()[-1]} < "
                f"max_seqs {self.max_seqs}; add a bucket >= max_seqs"
            )
        if self.max_model_len is None and self.prefill_len_buckets is None:
            return  # the default prefill chunk depends on the model's length: checked once resolved
        if self.prefill_lengths()[-1] > self.max_batched_tokens:
            raise ValueError(
                f"inference.max_batched_tokens ({self.max_batched_tokens}) must be >= the largest prefill "
                f"chunk ({self.prefill_lengths()[-1]}); raise it or lower prefill_len_buckets"
            )

    def decode_buckets(self) -> list[int]:
        if self.decode_batch_buckets:
            return self.decode_batch_buckets
        return [1] + _powers_of_two(8, self.max_seqs) if self.max_seqs > 1 else [1]

    def prefill_lengths(self) -> list[int]:
        return self.prefill_len_buckets or _powers_of_two(16, min(512, self.max_model_len), factor=4)

    def prefill_batches(self) -> list[int]:
        return self.prefill_batch_buckets or _powers_of_two(1, min(8, self.max_seqs))

    def program_bound(self) -> int:
        """Device programs the engine compiles (its start-up warm-up compiles all of them)."""
        # + the row copy of prefix reuse and the token-count reset of a penalised request
        return len(self.decode_shapes()) + len(self.prefill_shapes()) + 2

    def decode_step_counts(self) -> list[int]:
        """Decode steps per call the engine uses: ``decode_steps`` and ``decode_steps_idle``."""
        return sorted({self.decode_steps, self.decode_steps_idle or self.decode_steps})

    def decode_shapes(self) -> list[tuple[int, int]]:
        """(steps, batch) of every decode program (attention reads as far as the batch's longest
        sequence, whatever the cache length: no program per length)."""
        return [(k, b) for k in self.decode_step_counts() for b in self.decode_buckets()]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(batch, chunk length) of every prefill program."""
        return [(b, n) for b in self.prefill_batches() for n in self.prefill_lengths()]
