"""``[inference] backend = "external"``: rollouts from servers that run elsewhere
(``python -m jaxrl.serve`` on other hosts, or vLLM with ``inference.backend.server = "vllm"``),
listed in ``inference.base_url``.

    env servers -> loopback balancer (``proxy``) -> server 1 .. server N
    trainer     -> weights (direct from every trainer process, or files) -> POST /update_weights to each

After every optimizer step every server is given the trainer's parameters, in one of two ways
(``inference.backend.weight_transfer``):

- "direct" (the default for jaxrl servers): every trainer process starts a publisher
  (``jaxrl.weight_transfer.Publisher``, TCP, at ``weight_transfer_host`` on
  ``weight_transfer_port``, a free one when 0) at construction, and the processes learn each
  other's addresses once, at start. Each update, every process publishes its own shards of the new version (cast to ``[model] dtype``, the
  servers' dtype, on its devices: no gather to process 0, no files); process 0 describes them in
  a manifest (``manifest_for``: from the global shardings alone) and sends it to each server,
  ``POST /update_weights {"version", "manifest", "timeout_s"}``; each server pulls exactly the
  pieces its own layout needs from the processes that hold them, then swaps them in. With
  ``weight_transfer_delta`` (off by default) a version is published as a delta against the one
  before it (``weight_transfer_full_every``: one whole version every so many): a server that
  pulled exactly that base pulls only the changed blocks, any other pulls the version whole
  (``jaxrl.weight_transfer.delta``); each step logs what changed (``weights/changed_fraction``,
  process 0's shards). When every server serves 8-bit projections (``[inference.backend]
  quantization`` of ``jaxrl.serve``, read from its ``/metrics.json`` at start), the trainer
  quantizes them itself, exactly as the servers would (``models.quantize.quantize_param``), and
  sends int8 / fp8 values and their scales: about half a bfloat16 version's bytes. A server that cannot take a manifest fails the start with one line naming the fix (``weight_transfer =
  "files"``); nothing falls back to files on its own.
- "files" (the fallback, and the only way to vLLM servers): the parameters are written once as
  HF safetensors to a directory every server can read (a shared filesystem, or ``gs://`` through
  ``etils.epath``), then each server is told to load them (``POST /update_weights {"path",
  "version"}``; a vLLM server through its RL routes, as ``backend = "vllm"`` does). With several
  processes every process takes part in writing them (a cross-host gather).

Requests carry the ``Authorization: Bearer`` key when one is configured. The step's policy
version counts as served once every server has answered: the orchestrator's bounded off-policy
lag is then the same as with the embedded engine.

Servers keep their own version counters across runs (a server may have served another run or
an earlier attempt of this one), so the trainer's version ``v`` is sent as ``offset + v``, with
the offset chosen at start above every server's current version; the trainer's weights are
pushed at start, so every server serves exactly the trainer's policy from the first rollout.

A server that answers but cannot pull a version (its 400: an endpoint it cannot reach, the
pull's deadline, a format it does not serve) keeps serving the weights it has and counts the miss
in its metrics; the trainer logs it (``weights/servers_behind``) and goes on, and the server
catches up with the next version (pulled whole: its base is not the delta's). Only
``weight_transfer_max_behind`` misses in a row stop the run, naming the server and the last
reason; at start every server must take the trainer's weights. A server that stops answering -
a rollout request or a weight update reset, or not answered within ``request_timeout_s`` - is
reported by its URL as ``RolloutServerDead``; the RL
loop then checkpoints and stops, and ``--resume`` continues once the server is back: the resumed
run's start pushes the current version to every server before the balancer sends it a rollout,
so a restarted server never serves its base weights to the run. A direct
pull is bounded on the server too (a little under ``request_timeout_s``), so a trainer process
that cannot be reached is reported by the server's answer, naming the endpoint and the param.

Process 0 alone talks to the servers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.endpoint import ModelEndpoint
from jaxrl.models.decoder import Decoder
from jaxrl.models.quantize import Quantization, quantize_param
from jaxrl.parallel.distributed import broadcast_from_main, gather_strings
from jaxrl.rollout.base import RolloutServerDead
from jaxrl.rollout.config import ExternalConfig, InferenceConfig
from jaxrl.rollout.proxy import ProxyServer
from jaxrl.rollout.weight_files import WeightFiles, reload_vllm_weights, vllm_weight_version
from jaxrl.weight_transfer import Manifest, Publisher, manifest_for

logger = logging.getLogger(__name__)


class ServerRefused(RuntimeError):
    """A rollout server answered an error status (``status``); the message names it and why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ExternalBackend:
    """Servers at ``inference.base_url`` behind a loopback balancer, fed weights directly from
    every trainer process or through files (``inference.backend.weight_transfer``)."""

    def __init__(
        self,
        model: Decoder,
        hf_config: Mapping[str, Any],
        config: InferenceConfig,
        *,
        output_dir: str | Path,
        tokenizer_dir: str | Path,
        renderer: Mapping[str, Any] | None = None,
        replay_routing: bool = False,
    ):
        self.config = config
        self.replay_routing = replay_routing  # the trainer replays the servers' routing: they must return it
        if not isinstance(config.backend, ExternalConfig):
            raise TypeError(f'ExternalBackend: inference.backend.type is "{config.backend.type}", not "external"')
        self.ecfg = config.backend
        self.urls = config.server_urls()
        self.tokenizer_dir = str(tokenizer_dir)
        self.renderer = dict(renderer) if renderer is not None else None
        self.direct = self.ecfg.weight_transfer == "direct"
        self.weights: WeightFiles | None = None
        self.publisher: Publisher | None = None
        self._dtype = model.dtype  # the servers' parameter dtype ([model] dtype)
        self._quantization: Quantization = "none"  # what every server serves (learnt at start)
        if self.direct:  # every process serves its own shards of each version
            self.publisher = Publisher(
                dtype=None, prepare=self._prepare, block_bytes=jnp.dtype(model.dtype).itemsize,
                transport="tcp", host=self.ecfg.weight_transfer_host,
                port=self.ecfg.weight_transfer_port, advertise=self.ecfg.advertised_host(),
                delta=self.ecfg.weight_transfer_delta, full_every=self.ecfg.weight_transfer_full_every,
            )  # fmt: skip
        else:
            weights_root = self.ecfg.weights_dir or Path(output_dir) / "rollout_weights"
            self.weights = WeightFiles(model, hf_config, weights_root, for_vllm=self.ecfg.server == "vllm")
        self._endpoints: list[str] = []  # every process's publisher, by process index (at start)
        self.main = jax.process_index() == 0  # only process 0 talks to the servers
        self._model: Decoder | None = model
        self._version = -1  # nothing pushed yet
        self._weight_metrics: dict[str, float] = {}
        self._behind: dict[str, int] = {}  # direct: versions in a row each server failed to pull
        self._offset = self._offset_base = 0
        self._dead: RolloutServerDead | None = None
        self._endpoint: ModelEndpoint | None = None
        self.proxy: ProxyServer | None = None
        key = self.ecfg.resolve_api_key()
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._timeout = httpx.Timeout(self.ecfg.request_timeout_s, connect=self.ecfg.connect_timeout_s)
        self._http = httpx.Client(timeout=self._timeout)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, state: nnx.State | Decoder | None = None, version: int = 0) -> ModelEndpoint:
        """Wait for every server, check they serve one model, start the balancer, then push
        ``state`` (or the weights the backend was built with) as ``version``."""
        if self.publisher is not None:  # every process: learn where the others publish, once
            self._endpoints = gather_strings(self.publisher.address)
        failure: Exception | None = None
        if self.main:
            try:
                self._start_main()
            except Exception as e:  # noqa: BLE001 - told to every process, then raised here
                failure = e
        # Every process takes part in the weight export below: they all stop here if process 0 could not start.
        reason = broadcast_from_main(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if reason is not None:
            raise RuntimeError(f"process 0 could not reach the rollout servers: {reason}")
        # Every process prepares the same served form (the quantize is a program over global arrays).
        self._quantization = broadcast_from_main(self._quantization)
        self._offset = self._offset_base + 1 - version  # the first push is one above every server's version
        self.update_weights(self._model if state is None else state, version=version)
        self._model = None  # the trainer's state is passed at every update from now on
        return self._endpoint  # type: ignore[return-value]

    def _start_main(self) -> None:
        """Process 0: every server healthy and serving one model; the balancer in front of them."""
        versions = self._each(self._await_server)
        names = {u: n for u, (n, _, _) in versions.items()}
        if len(set(names.values())) > 1:
            raise ValueError(f"inference.base_url: the servers serve different models: {names}; serve one model")
        self._offset_base = max(v for _, v, _ in versions.values())
        kinds = {u: q for u, (_, _, q) in versions.items()}
        if self.direct and len(set(kinds.values())) == 1:
            self._quantization = next(iter(kinds.values()))
        elif self.direct:
            logger.warning(
                "rollout servers serve different quantizations (%s): weights travel in [model] dtype "
                "and each server quantizes its own", kinds,
            )  # fmt: skip
        self.proxy = ProxyServer(
            self.urls, self.config.server.host, self.config.server.port,
            timeout_s=self.ecfg.request_timeout_s, connect_timeout_s=self.ecfg.connect_timeout_s,
            keep_alive_s=self.config.server.keep_alive_s, on_unreachable=self._unreachable,
        )  # fmt: skip
        self.proxy.start()
        model = self.config.server.served_model_name or next(iter(names.values()))
        self._endpoint = ModelEndpoint.at(self.proxy.url, model, self.tokenizer_dir, self.renderer)

    def _await_server(self, url: str) -> tuple[str, int, Quantization]:
        """(served model id, current policy version, its weights' quantization) of ``url`` once
        it answers ``/health``."""
        deadline = time.monotonic() + self.ecfg.startup_timeout_s
        while True:
            try:
                if self._http.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rollout server {url} (inference.base_url) not healthy after "
                    f"{self.ecfg.startup_timeout_s:g} s (inference.backend.startup_timeout_s); is it running?"
                )
            time.sleep(0.5)
        model = self._get(url, "/v1/models")["data"][0]["id"]
        if self.replay_routing:
            self._check_returns_routing(url)
        if self.ecfg.server == "vllm":
            return model, vllm_weight_version(lambda method, route, **kw: self._call(url, method, route, **kw)), "none"
        metrics = self._engine_metrics(url)
        if not isinstance(metrics, dict) or "policy_version" not in metrics:
            raise ValueError(
                f"rollout server {url}: GET /metrics.json has no policy_version; backend = \"external\" drives "
                'jaxrl.serve servers; for vLLM servers set inference.backend.server = "vllm"'
            )
        if self.direct and not self._takes_manifests(url):
            raise ValueError(
                f"rollout server {url} does not take weights by manifest (POST /update_weights has no "
                '"manifest"; a jaxrl.serve older than direct transfer): update it, or set '
                'inference.backend.weight_transfer = "files"'
            )
        quantization = metrics.get("quantization", "none")  # a server from before quantization: none
        if quantization not in ("none", "int8", "fp8"):
            raise ValueError(f"rollout server {url}: GET /metrics.json names quantization {quantization!r}")
        return model, int(metrics["policy_version"]), quantization

    def _check_returns_routing(self, url: str) -> None:
        """Under routing replay, ``url`` must return each token's experts to the requests verifiers
        sends (no per-request switch): a one-token generate says so now, before any step, rather
        than the first rollout after the model is loaded and the run started."""
        body = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
        choice = self._call(url, "POST", "/inference/v1/generate", json=body).json()["choices"][0]
        if choice.get("routed_experts") is None:
            flag = (
                "vllm serve --enable-return-routed-experts" if self.ecfg.server == "vllm"
                else "jaxrl.serve --inference.server.return_routed_experts true"
            )
            raise ValueError(
                f'rollout server {url} returns no routed_experts, which trainer.moe_routing = "replay" needs: '
                f'start it as {flag}, or set trainer.moe_routing = "recompute"'
            )

    def _engine_metrics(self, url: str) -> Any:
        """``url``'s engine snapshot as JSON: ``GET /metrics.json``; a jaxrl.serve from before
        ``/metrics`` spoke Prometheus answers it at ``/metrics`` (None: neither is JSON)."""
        resp = self._http.get(f"{url}/metrics.json")
        if resp.status_code == 404:
            resp = self._http.get(f"{url}/metrics")
        if resp.status_code != 200:
            raise RuntimeError(f"rollout server {url}: GET {resp.url.path} answered {resp.status_code}: {resp.text[:500]}")
        try:
            return resp.json()
        except ValueError:  # Prometheus text: a vLLM server
            return None

    def _takes_manifests(self, url: str) -> bool:
        """Whether ``url``'s ``POST /update_weights`` takes a ``manifest`` (its OpenAPI schema says)."""
        resp = self._http.get(f"{url}/openapi.json")
        if resp.status_code != 200:
            return False
        try:
            doc = resp.json()
            body = doc["paths"]["/update_weights"]["post"]["requestBody"]["content"]["application/json"]["schema"]
            if "$ref" in body:
                body = doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[-1]]
            return "manifest" in body["properties"]
        except (KeyError, TypeError, ValueError):
            return False

    def _get(self, url: str, path: str) -> Any:
        resp = self._http.get(f"{url}{path}")
        if resp.status_code != 200:
            raise RuntimeError(f"rollout server {url}: GET {path} answered {resp.status_code}: {resp.text[:500]}")
        return resp.json()

    def collective(self) -> contextlib.AbstractContextManager[None]:
        """A section every trainer process runs together (nothing to order here)."""
        return contextlib.nullcontext()

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self.publisher is not None:
            self.publisher.stop()
        self._http.close()

    @property
    def endpoint(self) -> ModelEndpoint:
        assert self._endpoint is not None, "start() first (on process 0)"
        return self._endpoint

    # -- health ----------------------------------------------------------------------------

    def _unreachable(self, url: str, reason: str) -> None:
        if self._dead is None:
            logger.error("rollout server %s stopped answering: %s", url, reason)
            self._dead = RolloutServerDead(url, reason)

    def check(self) -> None:
        if self._dead is not None:
            raise self._dead

    def metrics(self) -> None:
        """Each server has its own ``GET /metrics`` (``/metrics.json``); the RL loop logs no ``engine/...`` keys."""
        return

    def token_versions(self, session_id: str) -> None:
        """Not fetched from remote servers (yet): each token carries its rollout's dispatch version."""

    # -- weights ---------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    def update_weights(self, state: nnx.State | Decoder, *, version: int) -> int:
        """Have every server serve ``state`` as ``version``: published by every process (direct)
        or written once (files), then announced to each server by process 0. Every process calls this."""
        if version <= self._version:
            raise ValueError(f"weight update version {version} must be greater than {self._version}")
        if self.publisher is not None:
            self._publish(nnx.state(state) if isinstance(state, Decoder) else state, version)
        else:
            self._write(state, version)
        self._version = version
        return version

    def _publish(self, state: nnx.State, version: int) -> None:
        """Direct: this process's shards held by its publisher; process 0 sends the manifest, and
        every process waits until the servers have answered it."""
        assert self.publisher is not None
        # All processes at once: a jitted cast per param. They publish the same versions with the
        # same settings, so every fragment names the same base; process 0's says which.
        fragment = self.publisher.publish(version, state)
        self._weight_metrics = self._changes(version, fragment.base_version)
        try:
            if self.main:
                self._announce(version, fragment)
        finally:
            # The servers pull from every process's publisher: no process may go on (and at the
            # run's end stop its publisher) before they have. Seen in the rendered GKE run: a
            # run resumed with every step done, process 1 stopped its publisher while the start's
            # push was being pulled, and the push failed at every restart.
            broadcast_from_main(None)

    def _announce(self, version: int, fragment: Manifest) -> None:
        """Process 0: the manifest of ``version`` to every server; a server that cannot pull it
        keeps serving what it had (``weight_transfer_max_behind`` misses in a row stop the run)."""
        self.check()
        manifest = manifest_for(
            version, self.publisher.layout(), self._endpoints, None, transport="tcp",
            lineage=self.publisher.lineage, base_version=fragment.base_version,
            block_bytes=None if fragment.base_version is None else self.publisher.block_bytes,
        )  # fmt: skip
        body = {
            "version": self._offset + version,
            "manifest": json.loads(manifest.to_json()),
            # The server gives up a little before this process does, so its answer (naming the
            # trainer endpoint and param that failed) arrives rather than a timeout of its own.
            "timeout_s": max(1.0, 0.9 * self.ecfg.request_timeout_s - 1.0),
        }
        missed = {url: why for url, why in self._each(lambda url: self._offer(url, body)).items() if why}
        for url in self.urls:
            self._behind[url] = self._behind.get(url, 0) + 1 if url in missed else 0
        self._weight_metrics["weights/servers_behind"] = float(len(missed))
        for url, why in missed.items():
            n, limit = self._behind[url], self.ecfg.weight_transfer_max_behind
            if n >= limit:
                raise RuntimeError(
                    f"rollout server {url} failed to pull {n} versions in a row "
                    f"(inference.backend.weight_transfer_max_behind = {limit}); the last: {why}"
                )
            logger.warning(
                "rollout server %s keeps serving its previous weights: it could not pull version %d (%d in a "
                "row of at most %d): %s", url, version, n, limit, why,
            )  # fmt: skip

    def _offer(self, url: str, body: dict[str, Any]) -> str | None:
        """POST a manifest to ``url``: None once it serves it, else why it could not pull it (its
        400; it keeps serving what it had). Unreachable -> ``RolloutServerDead``, as every call."""
        try:
            self._call(url, "POST", "/update_weights", json=body)
        except ServerRefused as e:
            if e.status != 400 or self._version < 0:  # the start's push: every server serves the trainer's weights
                raise
            return str(e)
        return None

    def _prepare(self, path: str, x: jax.Array) -> jax.Array | dict[str, jax.Array]:
        """One param as the servers serve it (the publisher's ``prepare``)."""
        return quantize_param(path, x, self._dtype, self._quantization)

    def _changes(self, version: int, base: int | None) -> dict[str, float]:
        """``weights/...`` metrics of a delta publisher's step (this process's shards)."""
        assert self.publisher is not None
        changes = self.publisher.changes(version)
        if changes is None:
            return {}
        return {
            "weights/changed_fraction": changes.fraction,  # bytes of the changed blocks / all bytes
            "weights/changed_blocks_fraction": changes.changed_blocks / max(changes.blocks, 1),
            "weights/delta": float(base is not None),  # 0: this version went out whole
        }

    def weight_metrics(self) -> dict[str, float]:
        """What the last weight update changed (direct with deltas; {} otherwise)."""
        return dict(self._weight_metrics)

    def _write(self, state: nnx.State | Decoder, version: int) -> None:
        """Files: ``state`` written once (every process takes part); process 0 has each server load it."""
        assert self.weights is not None
        path = self.weights.write(state, f"policy-{version:08d}")
        if self.main:
            self.check()
            body = {"path": str(path), "version": self._offset + version}
            self._each(lambda url: self._post_update(url, body))
            self.weights.served(path)

    def _post_update(self, url: str, body: dict[str, Any]) -> None:
        if self.ecfg.server == "vllm":
            request = lambda method, route, **kw: self._call(url, method, route, **kw)
            reload_vllm_weights(request, body["path"], body["version"], self.config.weight_update)
        else:
            self._call(url, "POST", "/update_weights", json=body)

    def _call(self, url: str, method: str, route: str, **kw: Any) -> httpx.Response:
        """One request to server ``url``; unreachable -> ``RolloutServerDead``, an error status -> RuntimeError."""
        try:
            resp = self._http.request(method, f"{url}{route}", headers=self._headers, **kw)
        except httpx.TransportError as e:
            self._unreachable(url, f"{method} {route}: {type(e).__name__}: {e}")
            raise self._dead from e  # type: ignore[misc]
        if resp.status_code >= 400:
            raise ServerRefused(
                resp.status_code,
                f"rollout server {url} refused {method} {route} ({resp.status_code}): {resp.text[:800]}"
                + (" - set inference.backend.api_key (or JAXRL_INFERENCE_API_KEY) to the server's key"
                   if resp.status_code == 401 else "")
            )  # fmt: skip
        return resp

    def _each(self, fn: Any) -> dict[str, Any]:
        """``fn(url)`` for every server at once; the first failure is raised."""
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            futures = {url: pool.submit(fn, url) for url in self.urls}
            return {url: f.result() for url, f in futures.items()}
