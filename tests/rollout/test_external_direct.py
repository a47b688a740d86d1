"""Direct weight transfer (``inference.backend.weight_transfer = "direct"``, the default for jaxrl
servers) between the external backend and a real ``python -m jaxrl.serve`` on 127.0.0.1: the
trainer (this process, its params sharded over 8 CPU devices) publishes each version and the
server pulls it over TCP and swaps it in. Every check is exact: the server's seeded generation
(tokens and log-probs) after a direct push equals its generation after loading the same
checkpoint from disk. Bad manifests get a 400 naming what is wrong, and a pull that fails
leaves the server serving its previous version."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import jax
import pytest
import uvicorn
from engine_fixtures import make_qwen3
from external_servers import free_port, start_servers
from fastapi import FastAPI
from flax import nnx
from pydantic import BaseModel

from jaxrl.models.decoder import Decoder
from jaxrl.models.hf_io import load_decoder
from jaxrl.models.sharding import param_sharding_fn
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.rollout.config import InferenceConfig
from jaxrl.rollout.external import ExternalBackend
from jaxrl.weight_transfer import Publisher, manifest_for

# Starts process trees of its own: one such module at a time (conftest).
pytestmark = pytest.mark.usefixtures("one_process_tree_at_a_time")

# Small engine shapes: the server compiles every program at start.
SIZES = {"max_model_len": 128, "max_seqs": 4, "max_batched_tokens": 64}
ENGINE = {"decode_steps": 3, "decode_batch_buckets": [4], "prefill_len_buckets": [32], "prefill_batch_buckets": [2]}
PROMPT = [5, 9, 13, 2, 7, 11]
SAMPLING = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "logprobs": 1, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(model_dir, tokenizer_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve_logs")
    (serve,) = start_servers(
        model_dir, logs, n=1, sizes=SIZES, engine=ENGINE, extra=("--model.tokenizer", str(tokenizer_dir))
    )
    yield serve
    serve.kill()


def generate(url: str) -> dict[str, Any]:
    """The server's seeded answer to ``PROMPT``: tokens, log-probs, the policy version."""
    r = httpx.post(f"{url}/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": SAMPLING}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {
        "tokens": choice["token_ids"],
        "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
        "version": choice["policy_version"],
    }


def served(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    return answer["tokens"], answer["logprobs"]


def trainer_model(model_dir: Path) -> Decoder:
    """A checkpoint as the trainer holds it: float32, every param sharded over the 8 devices (fsdp)."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))
    return load_decoder(model_dir, sharding_fn=param_sharding_fn(mesh))


def hf_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def external(url: str, **backend: Any) -> InferenceConfig:
    return InferenceConfig(
        backend="external", base_url=[url + "/v1"], server={"port": 0},
        external={"request_timeout_s": 60, "startup_timeout_s": 30, **backend},
    )  # fmt: skip


def test_direct_pushes_serve_the_trainers_weights_bit_for_bit(server, model_dir, tokenizer_dir, tmp_path) -> None:
    checkpoints = [make_qwen3(tmp_path / f"seed{s}", seed=s) for s in (1, 2)]
    from_disk = generate(server.url)  # the checkpoint jaxrl.serve loaded at start
    v0 = from_disk["version"]
    cfg = external(server.url, weight_transfer_delta=True)
    assert cfg.backend.weight_transfer == "direct"
    model = trainer_model(model_dir)
    backend = ExternalBackend(model, hf_config(model_dir), cfg, output_dir=tmp_path, tokenizer_dir=tokenizer_dir)
    try:
        backend.start(nnx.state(model), version=0)  # pushes the trainer's weights as the server's v0 + 1
        first = generate(server.url)
        assert first["version"] == v0 + 1 and served(first) == served(from_disk)
        pushed = []
        for version, checkpoint in enumerate(checkpoints, start=1):
            assert backend.update_weights(nnx.state(trainer_model(checkpoint)), version=version) == version
            pushed.append(generate(server.url))
            assert pushed[-1]["version"] == v0 + 1 + version
            # A delta against the version before (deltas on): another random
            # checkpoint changes nearly every block (not the norms' ones).
            metrics = backend.weight_metrics()
            assert metrics["weights/delta"] == 1.0 and 0.5 < metrics["weights/changed_fraction"] <= 1.0
        # The same weights again: a delta of no block, and the server answers as before.
        assert backend.update_weights(nnx.state(trainer_model(checkpoints[-1])), version=3) == 3
        assert backend.weight_metrics()["weights/changed_fraction"] == 0.0
        again = generate(server.url)
        assert again["version"] == v0 + 4 and served(again) == served(pushed[-1])
        assert backend.publisher.versions == [2, 3]  # the newest two held; no files written
        assert not (tmp_path / "rollout_weights").exists()
    finally:
        backend.stop()
    assert served(pushed[0]) != served(first) and served(pushed[1]) != served(pushed[0])
    # Each pushed version answers exactly as the same checkpoint loaded from disk by the same server.
    for checkpoint, answer in zip(checkpoints, pushed, strict=True):
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(checkpoint)}, timeout=120)
        assert r.status_code == 200, r.text
        assert served(generate(server.url)) == served(answer)


@pytest.mark.slow  # a second jaxrl.serve process (int8): the slow tier
def test_an_int8_server_is_sent_int8_weights_it_serves_as_its_own_quantize(model_dir, tokenizer_dir, tmp_path) -> None:
    """Quantized transfer (issue 40 item 3): a server serving int8 says so in /metrics.json, the
    trainer quantizes on its side and sends values + scales (about half the bytes), and the server
    answers exactly as after loading the same checkpoint from disk and quantizing it itself."""
    (serve,) = start_servers(
        model_dir, tmp_path, n=1, sizes=SIZES, engine=ENGINE,
        extra=("--model.tokenizer", str(tokenizer_dir), "--inference.backend.quantization", "int8"),
    )  # fmt: skip
    try:
        assert serve.metrics()["quantization"] == "int8"
        checkpoint = make_qwen3(tmp_path / "seed1", seed=1)
        model = trainer_model(model_dir)
        backend = ExternalBackend(
            model, hf_config(model_dir), external(serve.url), output_dir=tmp_path, tokenizer_dir=tokenizer_dir
        )
        try:
            backend.start(nnx.state(model), version=0)
            backend.update_weights(nnx.state(trainer_model(checkpoint)), version=1)
            pushed = generate(serve.url)
            layout = backend.publisher.layout()
        finally:
            backend.stop()
        assert {str(x.dtype) for p, x in layout.items() if p.endswith("/values")} == {"int8"}
        sent = sum(x.size * x.dtype.itemsize for x in layout.values())
        full = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(model)))  # the trainer's float32 params
        assert sent < 0.55 * full
        r = httpx.post(f"{serve.url}/update_weights", json={"path": str(checkpoint)}, timeout=120)
        assert r.status_code == 200, r.text
        assert served(generate(serve.url)) == served(pushed)
    finally:
        serve.kill()


def test_bad_manifests_get_400_and_the_server_keeps_its_weights(server, model_dir) -> None:
    before = generate(server.url)
    state = nnx.state(trainer_model(model_dir))

    def update(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/update_weights", json=body, timeout=60)

    sources = "give exactly one of path (a model directory) or manifest (a weight manifest)"
    manifest = json.loads(manifest_for(1, state, ["127.0.0.1:1"], "float32").to_json())
    for body, message in (
        ({}, f"{sources}, not neither"),
        ({"path": str(model_dir), "manifest": manifest}, f"{sources}, not both"),
        ({"manifest": {"version": 1}}, "manifest: not a weight manifest"),
        ({"path": str(model_dir), "timeout_s": 5}, "timeout_s: only with manifest"),
    ):
        r = update(body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)

    # A trainer endpoint that is gone: refused at once, naming the endpoint and the param.
    dead = f"127.0.0.1:{free_port()}"
    gone = json.loads(manifest_for(1, state, [dead], "float32").to_json())
    t0 = time.monotonic()
    r = update({"manifest": gone, "timeout_s": 20})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and f"failed at endpoint 0 ({dead}), param '" in message, r.text
    assert "ConnectionRefusedError" in message and time.monotonic() - t0 < 10
    # A live publisher that does not hold the version asked for: its own reason, named.
    with Publisher(dtype="float32") as publisher:
        publisher.publish(5, state)
        stale = json.loads(manifest_for(4, state, [publisher.address], "float32").to_json())
        r = update({"manifest": stale, "timeout_s": 20})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and f"version 4 is not held by the publisher at {publisher.address}" in message
    # A manifest of another model's params: 400 naming the mismatch, nothing pulled.
    other = json.loads(manifest_for(1, {"w": state["embed"]}, [dead], "float32").to_json())
    r = update({"manifest": other})
    assert r.status_code == 400 and "the target lacks ['w']" in r.json()["error"]["message"], r.text

    after = generate(server.url)  # the same weights and version as before every failed update
    assert after["version"] == before["version"] and served(after) == served(before)
    assert httpx.get(f"{server.url}/health").json()["policy_version"] == before["version"]


class UpdateWeightsRequest(BaseModel):
    path: str
    version: int | None = None


def test_a_server_that_cannot_pull_keeps_its_weights_the_run_goes_on_and_it_catches_up(
    server, model_dir, tokenizer_dir, tmp_path, caplog
) -> None:
    """A pull that fails on one server (here: the trainer sends int8 weights, as if the server had
    restarted without quantization) is a warning and a metric, not the end of the run: the server
    keeps its weights and says so in its metrics, takes the next version whole, and only
    ``weight_transfer_max_behind`` misses in a row stop the run, naming it."""
    model = trainer_model(model_dir)
    other = nnx.state(trainer_model(make_qwen3(tmp_path / "seed3", seed=3)))
    cfg = external(server.url, weight_transfer_max_behind=2)
    backend = ExternalBackend(model, hf_config(model_dir), cfg, output_dir=tmp_path, tokenizer_dir=tokenizer_dir)
    try:
        backend.start(nnx.state(model), version=0)
        before = generate(server.url)
        failures = server.metrics()["weight_update_failures"]
        backend._quantization = "int8"  # what a server serving int8 would be sent; this one serves "none"
        with caplog.at_level(logging.WARNING, logger="jaxrl.rollout.external"):
            assert backend.update_weights(other, version=1) == 1
        assert f"rollout server {server.url} keeps serving its previous weights" in caplog.text
        assert "trainer sent int8 weights but this server serves quantization" in caplog.text
        assert backend.weight_metrics()["weights/servers_behind"] == 1.0
        metrics = server.metrics()
        assert metrics["weight_update_failures"] == failures + 1 and "int8" in metrics["last_weight_update_error"]
        assert generate(server.url) == before  # the same weights and version as before the miss
        backend._quantization = "none"
        backend.update_weights(other, version=2)  # caught up
        after = generate(server.url)
        assert after["version"] == before["version"] + 2 and served(after) != served(before)
        assert backend.weight_metrics()["weights/servers_behind"] == 0.0
        backend._quantization = "int8"
        backend.update_weights(other, version=3)
        with pytest.raises(RuntimeError, match=rf"rollout server {server.url} failed to pull 2 versions in a row "
                                               r"\(inference\.backend\.weight_transfer_max_behind = 2\)"):  # fmt: skip
            backend.update_weights(other, version=4)
        backend._quantization = "none"
        backend.update_weights(nnx.state(model), version=5)  # the module's server serves the start's weights again
        assert served(generate(server.url)) == served(before)
    finally:
        backend.stop()


def old_server_app() -> FastAPI:
    """What a jaxrl.serve from before direct transfer answers: ``/update_weights`` takes a path only."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny", "max_model_len": 128}]}

    @app.get("/metrics")
    async def metrics() -> dict:
        return {"policy_version": 0}

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> dict:
        return {"policy_version": body.version or 1}

    return app


def test_a_server_without_manifests_fails_the_start_naming_the_fix(model_dir, tokenizer_dir, tmp_path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    old = uvicorn.Server(uvicorn.Config(old_server_app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=old.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        model = load_decoder(model_dir)
        backend = ExternalBackend(model, hf_config(model_dir), external(url), output_dir=tmp_path,
                                  tokenizer_dir=tokenizer_dir)  # fmt: skip
        try:
            with pytest.raises(ValueError, match=rf'rollout server {url} does not take weights by manifest.*'
                               r'or set inference\.backend\.weight_transfer = "files"'):  # fmt: skip
                backend.start(version=0)
        finally:
            backend.stop()
    finally:
        old.should_exit = True
        thread.join()


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ({"server": "vllm", "weight_transfer": "direct"},
         ('inference.backend.weight_transfer = "direct" needs jaxrl.serve servers; vLLM servers load weights from '
          'files: set weight_transfer = "files"')),
        ({"weight_transfer": "tcp"}, "weight_transfer"),
        ({"weight_transfer_host": "http://0.0.0.0"},
         "inference.backend.weight_transfer_host = 'http://0.0.0.0': give a host name or an IP address"),
        ({"weight_transfer_host": "10.0.0.1:9000"}, "weight_transfer_host"),
        ({"weight_transfer_advertise": "0.0.0.0"}, "servers cannot dial a wildcard address"),
        ({"weight_transfer_advertise": ""}, "weight_transfer_advertise"),
        ({"weight_transfer_port": 65536}, "weight_transfer_port"),  # a TCP port, or 0 for a free one
        ({"weight_transfer_port": -1}, "weight_transfer_port"),
        ({"weight_transfer_full_every": 0}, "weight_transfer_full_every"),
        ({"weight_transfer_delta": "sometimes"}, "weight_transfer_delta"),
    ],
)  # fmt: skip
def test_weight_transfer_config_is_checked_in_one_line(backend, message) -> None:
    with pytest.raises(ValueError, match="weight_transfer") as e:
        InferenceConfig.model_validate({"backend": {"type": "external", **backend}, "base_url": "http://a:1"})
    assert message in str(e.value)


def test_weight_transfer_defaults() -> None:
    def resolve(**backend: Any) -> Any:
        return InferenceConfig.model_validate(
            {"backend": {"type": "external", **backend}, "base_url": "http://a:1"}
        ).backend

    jaxrl = resolve()
    assert (jaxrl.weight_transfer, jaxrl.weight_transfer_host, jaxrl.weight_transfer_advertise) == (
        "direct", "127.0.0.1", None
    )
    assert jaxrl.weight_transfer_port == 0  # a free port: one host needs no fixed one
    assert jaxrl.advertised_host() == "127.0.0.1"
    assert (jaxrl.weight_transfer_delta, jaxrl.weight_transfer_full_every) == (False, 10)
    assert resolve(server="vllm").weight_transfer == "files"  # vLLM servers load files
    assert resolve(server="vllm", weight_transfer="files").weight_transfer == "files"
    assert resolve(weight_transfer="files").weight_transfer == "files"
    assert resolve(weight_transfer_host="0.0.0.0").advertised_host() == socket.gethostname()
    wild = resolve(weight_transfer_host="::", weight_transfer_advertise="trainer-0.rt")
    assert wild.advertised_host() == "trainer-0.rt"
    assert resolve(weight_transfer_host="fe80::1").advertised_host() == "fe80::1"
