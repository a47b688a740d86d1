"""The trainer's weights handed to rollout servers through files: HF safetensors written once
per policy version (``WeightFiles``), in the form vLLM reloads correctly (``export_for_vllm``),
and vLLM's reload protocol (``reload_vllm_weights``, ``vllm_weight_version``).

Shared by the two file-fed backends: ``vllm.VLLMBackend`` (one server it launched or attached
to) and ``external.ExternalBackend`` (jaxrl.serve or vLLM servers running elsewhere).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import jax
import numpy as np
from etils import epath
from flax import nnx
from safetensors.numpy import save_file

from jaxrl.models.decoder import Decoder
from jaxrl.models.hf_io import copy_model_dir, export_hf, is_url


def export_for_vllm(
    model: Decoder, out_dir: Path, hf_config: Mapping[str, Any], *, all_processes_write: bool = False
) -> Path:
    """``export_hf`` in the form a vLLM 0.32 server loads and reloads correctly.

    Two fixes on top of the plain export:
    - ``architectures`` is filled in from ``model_type`` when missing (configs of models built
      from scratch carry ``null``): without it vLLM resolves the bare ``Qwen3Model`` and serves
      it as an embedding model, with no generate routes.
    - A tied ``lm_head`` is untied (a copy of the embedding; the same function). vLLM's in-place
      ``reload_weights`` does not reload a tied head: its layerwise reload finds no checkpoint
      tensor for the ``ParallelLMHead`` (vLLM skips ``lm_head.*`` when tied), logs
      "ParallelLMHead: Failed to load weights" and puts the *old* head back, so the server would
      sample from new layers and an old head. Untied, the head is an ordinary weight.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hf_config = dict(hf_config)
    if not hf_config.get("architectures"):
        hf_config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config["model_type"]]]
    path = export_hf(model, out_dir, hf_config, all_processes_write=all_processes_write)
    if not model.arch.tie_word_embeddings:
        return path
    embed = model.embed[...]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        embed = multihost_utils.process_allgather(embed, tiled=True)
    if jax.process_index() != 0:
        return path
    save_file(
        {"lm_head.weight": np.ascontiguousarray(jax.device_get(embed))},
        path / "lm_head.safetensors",
        metadata={"format": "pt"},
    )
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}, indent=2))
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
        index.write_text(json.dumps(data, indent=2))
    return path


def reload_vllm_weights(request: Callable[..., httpx.Response], path: str, version: int, weight_update: str) -> None:
    """Have a vLLM server (``VLLM_SERVER_DEV_MODE=1``) serve the HF safetensors at ``path`` as
    ``version``, through ``request(method, route, **httpx_kwargs)`` (which raises on errors).
    ``weight_update`` "drain" lets requests in flight finish first; "immediate" freezes them."""
    request("POST", "/pause", params={"mode": "wait" if weight_update == "drain" else "keep"})
    try:
        request("POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": path}})
        request("POST", "/reset_prefix_cache")  # cached prefixes were computed by the old weights
        request("POST", "/update_weight_version", json={"new_version": str(version)})
    finally:
        request("POST", "/resume")


def vllm_weight_version(request: Callable[..., httpx.Response]) -> int:
    """The policy version a vLLM server reports (``GET /weight_info``; 0 before any reload)."""
    version = request("GET", "/weight_info").json().get("weight_version")
    return int(version) if isinstance(version, str) and version.isdigit() else 0


class WeightFiles:
    """One HF safetensors directory per policy version under ``root`` (a local path, or a URL
    such as ``gs://`` through ``etils.epath``), the previous one removed once the next is served.

    Holds what a file-fed backend keeps of the trainer's model: its graph (to turn a state into
    a ``Decoder``) and its HF config. Every process writes (a cross-host gather inside the
    export); process 0 alone copies to a URL and removes old directories.
    """

    def __init__(self, model: Decoder, hf_config: Mapping[str, Any], root: str | Path, *, for_vllm: bool):
        self.graphdef = nnx.graphdef(model)
        self.hf_config = dict(hf_config)
        self.root = epath.Path(root)
        self.for_vllm = for_vllm
        self._main = jax.process_index() == 0
        self._last: epath.Path | None = None
        self._shared: bool | None = None  # every process sees root (decided at the first write)

    def _all_see_root(self) -> bool:
        """Whether every trainer process sees the same ``root`` (a bucket URL, a shared mount):
        process 0 writes a probe, each process looks for it, and they agree on the minimum. Then
        every process writes its share of the shard files at once; else process 0 writes alone."""
        if jax.process_count() == 1:
            return False
        from jax.experimental import multihost_utils

        probe = self.root / f".jaxrl-shared-probe-{os.getpid()}-{time.time_ns()}"
        probe_name = multihost_utils.broadcast_one_to_all(np.frombuffer(probe.name.encode().ljust(64), np.uint8))
        probe = self.root / bytes(np.asarray(probe_name)).decode().strip()
        if self._main:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_text("jaxrl")
        multihost_utils.sync_global_devices("jaxrl-weights-probe-written")
        seen = np.int32(probe.exists())
        shared = bool(np.min(multihost_utils.process_allgather(seen)))
        multihost_utils.sync_global_devices("jaxrl-weights-probe-read")
        if self._main:
            probe.unlink(missing_ok=True)
        return shared

    def write(self, state: nnx.State | Decoder, name: str) -> epath.Path:
        """``state`` as HF safetensors in ``root / name``: written in place on a local path
        (returned absolute: servers may run elsewhere), staged then copied to a URL. Where every
        process sees ``root``, each writes its share of the files and all wait for the last."""
        if self._shared is None:
            self._shared = self._all_see_root()
        model = state if isinstance(state, Decoder) else nnx.merge(self.graphdef, state)
        dest = self.root / name
        export = partial(export_for_vllm if self.for_vllm else export_hf, all_processes_write=self._shared)
        if not is_url(dest):
            path = epath.Path(export(model, Path(dest), self.hf_config).resolve())
        else:
            with tempfile.TemporaryDirectory(prefix="jaxrl-weights-") as tmp:
                local = export(model, Path(tmp) / dest.name, self.hf_config)
                if self._main or self._shared:
                    copy_model_dir(local, dest, require_config=self._main)
            path = dest
        if self._shared:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxrl-weights-written-{name}")
        return path

    def served(self, path: epath.Path) -> None:
        """``path`` is now served everywhere: the directory served before it is removed."""
        if self._main and self._last is not None:
            self._last.rmtree(missing_ok=True)
        self._last = path
