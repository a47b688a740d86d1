"""The vLLM proxy and vLLM backend's config, without vLLM: a small upstream app on
127.0.0.1 answers the way a vLLM 0.32 server does, and real clients (renderers' generate,
httpx) go through the real proxy."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from openai import AsyncOpenAI
from pydantic import ValidationError
from renderers import Qwen3RendererConfig, create_renderer
from renderers.client import MalformedGenerateResponseError, generate
from transformers import AutoTokenizer

from jaxrl.models.hf_io import load_decoder
from jaxrl.rollout.config import InferenceConfig, VLLMConfig
from jaxrl.rollout.proxy import ProxyServer, rewrite_generate_response
from jaxrl.rollout.vllm import VLLMBackend

LOGPROBS = [-0.25, -1.5, -0.125]


def vllm_like_app(seen: list[dict], completion: list[int]) -> FastAPI:
    """Answers like vLLM 0.32 with --enable-scale-out: "tokens" output mode log-probs."""
    app = FastAPI()

    @app.post("/inference/v1/generate")
    async def gen(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append({"body": body, "session": request.headers.get("x-session-id")})
        if body["sampling_params"].get("max_tokens", 1) < 1:
            return JSONResponse({"error": {"message": "max_tokens must be at least 1"}}, status_code=400)
        content = [{"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []} for t, lp in zip(completion, LOGPROBS)]
        return JSONResponse({
            "request_id": "gen-1", "output_mode": "tokens", "prompt_token_ids": body["token_ids"],
            "choices": [{"index": 0, "token_ids": completion, "logprobs": {"content": content},
                         "finish_reason": "stop", "weight_versions": [{"start": 0, "end": 3, "version": "4"}]}],
            "usage": {"prompt_tokens": len(body["token_ids"]), "completion_tokens": 3},
        })

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "max_model_len": 4096,
                                                         "echo_query": dict(request.query_params)}]})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/weight_info")
    async def weight_info() -> JSONResponse:
        versions = [c["json"]["new_version"] for c in seen if c.get("route") == "update_weight_version"]
        return JSONResponse({"weight_version": versions[-1] if versions else None})

    @app.api_route("/{route}", methods=["POST"])
    async def control(route: str, request: Request) -> JSONResponse:
        """The RL routes a weight sync uses (VLLM_SERVER_DEV_MODE=1)."""
        body = await request.body()
        seen.append({"route": route, "query": dict(request.query_params), "json": json.loads(body) if body else None})
        return JSONResponse({"results": [None]} if route == "collective_rpc" else {"success": True})

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> Iterator[bytes]:
            for i in range(3):
                yield f"data: {i}\n\n".encode()
        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


class Upstream:
    def __init__(self, app: FastAPI):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "upstream did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


@pytest.fixture(scope="module")
def completion(tokenizer_dir) -> list[int]:
    """'Hi' then <|im_end|> (the Qwen3 renderer's stop token)."""
    return AutoTokenizer.from_pretrained(tokenizer_dir).encode("Hi<|im_end|>", add_special_tokens=False)


@pytest.fixture(scope="module")
def upstream(completion):
    seen: list[dict] = []
    up = Upstream(vllm_like_app(seen, completion))
    up.seen = seen
    yield up
    up.stop()


@pytest.fixture(scope="module")
def proxy(upstream):
    srv = ProxyServer(upstream.url)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def renderer(tokenizer_dir):
    return create_renderer(AutoTokenizer.from_pretrained(tokenizer_dir), Qwen3RendererConfig(enable_thinking=False))


def _renderers_generate(base_url: str, renderer) -> dict:
    async def run() -> dict:
        client = AsyncOpenAI(base_url=base_url + "/v1", api_key="none")
        try:
            return await generate(
                client=client, renderer=renderer, messages=[{"role": "user", "content": "hi"}], model="tiny",
                sampling_params={"max_tokens": 8, "temperature": 1.0}, extra_headers={"X-Session-ID": "s-1"},
            )
        finally:
            await client.close()

    return asyncio.run(run())


def test_renderers_rejects_vllm_tokens_mode_directly(upstream, renderer, completion) -> None:
    """Why the proxy exists: renderers 0.1.12 cannot read vLLM's default generate answer."""
    with pytest.raises(MalformedGenerateResponseError, match=f"token must be 'token_id:{completion[0]}'"):
        _renderers_generate(upstream.url, renderer)


def test_renderers_reads_generate_through_proxy(proxy, upstream, renderer, completion) -> None:
    out = _renderers_generate(proxy.url, renderer)
    assert out["completion_ids"] == completion and len(completion) == 3
    assert out["completion_logprobs"] == LOGPROBS
    assert out["content"] == "Hi" and out["finish_reason"] == "stop"
    sent = upstream.seen[-1]
    # The request reached vLLM as the client sent it (no output_mode added), header included.
    assert sent["session"] == "s-1" and "output_mode" not in sent["body"]
    assert sent["body"]["token_ids"] == out["prompt_ids"] and sent["body"]["sampling_params"]["logprobs"] == 1


def test_generate_response_keeps_vllm_fields_and_both_token_forms(proxy, completion) -> None:
    body = {"model": "tiny", "token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}
    data = httpx.post(f"{proxy.url}/inference/v1/generate", json=body).json()
    choice = data["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in completion]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == completion
    assert choice["weight_versions"] == [{"start": 0, "end": 3, "version": "4"}]
    assert data["prompt_token_ids"] == [1, 2] and data["usage"]["completion_tokens"] == 3


def test_other_routes_errors_and_streams_pass_through(proxy) -> None:
    models = httpx.get(f"{proxy.url}/v1/models", params={"a": "b"}).json()
    assert models["data"][0]["max_model_len"] == 4096 and models["data"][0]["echo_query"] == {"a": "b"}
    bad = httpx.post(f"{proxy.url}/inference/v1/generate",
                     json={"model": "tiny", "token_ids": [1], "sampling_params": {"max_tokens": 0}})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    with httpx.stream("GET", f"{proxy.url}/stream") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert b"".join(resp.iter_raw()) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert httpx.get(f"{proxy.url}/no/such/route").status_code == 404


def test_unreachable_upstream_is_a_502_naming_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    srv = ProxyServer(dead)
    srv.start()
    try:
        resp = httpx.get(f"{srv.url}/health")
        assert resp.status_code == 502 and dead in resp.json()["error"]["message"]
    finally:
        srv.stop()


def test_rewrite_handles_text_mode_and_missing_ids() -> None:
    payload = {"choices": [
        {"token_ids": [5, 6, 7], "logprobs": {"content": [
            {"token": "token_id:5", "logprob": -1.0},  # text mode with --return-tokens-as-token-ids
            {"logprob": -2.0},  # no id at all: taken from token_ids
            {"token": "x", "logprob": -3.0, "token_id": 7},
        ]}},
        {"token_ids": [1], "logprobs": None},
        "not a choice",
    ]}
    out = rewrite_generate_response(json.loads(json.dumps(payload)))
    entries = out["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["token_id"], e["logprob"]) for e in entries] == [
        ("token_id:5", 5, -1.0), ("token_id:6", 6, -2.0), ("token_id:7", 7, -3.0)
    ]
    assert out["choices"][1:] == payload["choices"][1:]
    unknown = {"choices": [{"token_ids": [], "logprobs": {"content": [{"token": "?", "logprob": -1.0}]}}]}
    assert rewrite_generate_response(unknown)["choices"][0]["logprobs"]["content"] == [{"token": "?", "logprob": -1.0}]


# -- backend attached to a server (no launch) --------------------------------------------


def test_attached_backend_syncs_weights_with_vllm_routes_in_order(upstream, model_dir, tokenizer_dir, tmp_path) -> None:
    cfg = InferenceConfig(backend="vllm", base_url=upstream.url + "/v1", server={"port": 0},
                          vllm={"weights_dir": str(tmp_path / "w")})
    model = load_decoder(model_dir)
    backend = VLLMBackend(model, json.loads((model_dir / "config.json").read_text()), cfg, output_dir=tmp_path,
                          tokenizer_dir=tokenizer_dir, model_name="ignored")
    backend.start()
    try:
        assert backend.endpoint.model == "tiny"  # read from the attached server's /v1/models
        assert backend.endpoint.base_url == f"{backend.proxy.url}/v1" and backend.policy_version == 0
        for version in (3, 4):
            del upstream.seen[:]
            assert backend.update_weights(model, version=version) == version
            calls = [(c["route"], c["query"], c["json"]) for c in upstream.seen]
            path = tmp_path / "w" / f"update-{version:08d}"
            assert calls == [
                ("pause", {"mode": "wait"}, None),
                ("collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}),
                ("reset_prefix_cache", {}, None),
                ("update_weight_version", {}, {"new_version": str(version)}),
                ("resume", {}, None),
            ]
        assert backend.policy_version == 4
        assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["update-00000004"]  # the older one removed
        # Tied embeddings are served untied (vLLM 0.32 does not reload a tied head).
        assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False
        assert (path / "lm_head.safetensors").exists() and (path / "model.safetensors").exists()
        with pytest.raises(ValueError, match="version 4 must be greater than 4"):
            backend.update_weights(model, version=4)
    finally:
        backend.stop()
    assert not backend.running


def test_external_vllm_servers_get_every_version_through_vllm_routes(model_dir, tokenizer_dir, tmp_path, completion) -> None:
    """backend = "external" with inference.backend.server = "vllm" (the GKE layout: several
    vLLM servers): each server reloads every version through vLLM's RL routes, in order."""
    from jaxrl.rollout.external import ExternalBackend

    seen: list[list[dict]] = [[], []]
    ups = [Upstream(vllm_like_app(s, completion)) for s in seen]
    cfg = InferenceConfig(backend="external", base_url=[u.url + "/v1" for u in ups], server={"port": 0},
                          external={"server": "vllm", "weights_dir": str(tmp_path / "w")})  # fmt: skip
    model = load_decoder(model_dir)
    backend = ExternalBackend(model, json.loads((model_dir / "config.json").read_text()), cfg, output_dir=tmp_path,
                              tokenizer_dir=tokenizer_dir)  # fmt: skip
    try:
        assert backend.start(version=0).model == "tiny"
        backend.update_weights(model, version=1)
        path = tmp_path / "w" / "policy-00000001"
        for s in seen:
            calls = [(c["route"], c["json"]) for c in s if "route" in c]
            assert calls[-5:] == [
                ("pause", None),
                ("collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}),
                ("reset_prefix_cache", None),
                ("update_weight_version", {"new_version": "2"}),  # start pushed "1" (the server had none)
                ("resume", None),
            ]
        assert backend.policy_version == 1
        assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False  # vLLM's export
    finally:
        backend.stop()
        for u in ups:
            u.stop()


def test_attach_timeout_names_the_setting(model_dir, tokenizer_dir, tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cfg = InferenceConfig(backend="vllm", base_url=dead + "/v1", vllm={"startup_timeout_s": 1})
    with pytest.raises(TimeoutError, match=r"not healthy after 1 s \(inference.backend.startup_timeout_s\)"):
        VLLMBackend(load_decoder(model_dir), {}, cfg, output_dir=tmp_path, tokenizer_dir=tokenizer_dir, model_name="m").start()


# -- config -------------------------------------------------------------------------------


def test_vllm_config_fields_and_errors(monkeypatch, tmp_path) -> None:
    cfg = InferenceConfig(backend="vllm", vllm={"dtype": "float32", "extra_args": ["--enforce-eager"]})
    assert cfg.backend.dtype == "float32" and cfg.backend.extra_args == ["--enforce-eager"] and cfg.base_url is None
    with pytest.raises(ValidationError, match="extra_forbidden"):
        InferenceConfig(backend="vllm", vllm={"pyhton": "/x"})
    with pytest.raises(ValidationError, match="cpu_kv_cache_gib"):
        VLLMConfig(cpu_kv_cache_gib=0)
    with pytest.raises(ValidationError, match="inference.base_url must start with http"):
        InferenceConfig(backend="vllm", base_url="10.0.0.2:8000/v1")
    assert InferenceConfig(backend="vllm", base_url="http://10.0.0.2:8000/v1").base_url.endswith("/v1")

    monkeypatch.delenv("JAXRL_VLLM", raising=False)
    with pytest.raises(ValueError, match="JAXRL_VLLM is not set.*install_vllm_cpu.sh"):
        VLLMConfig().resolve_python()
    not_exec = tmp_path / "python"
    not_exec.write_text("")
    monkeypatch.setenv("JAXRL_VLLM", str(not_exec))
    with pytest.raises(ValueError, match="not an executable python"):
        VLLMConfig().resolve_python()
    os.chmod(not_exec, 0o755)
    assert VLLMConfig().resolve_python() == str(not_exec)
    assert VLLMConfig(python="/usr/bin/env").resolve_python() == "/usr/bin/env"  # the field wins


# -- several upstreams (backend = "external") -----------------------------------------------


def test_balancer_is_sticky_per_session_spreads_the_rest_and_names_a_dead_server(completion) -> None:
    seen = [[], []]
    ups = [Upstream(vllm_like_app(s, completion)) for s in seen]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    reported: list[tuple[str, str]] = []
    srv = ProxyServer([u.url for u in ups], on_unreachable=lambda url, why: reported.append((url, why)))
    srv.start()
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
    try:
        for turn in range(3):  # three sessions of three turns each, interleaved
            for session in ("a", "b", "c"):
                resp = httpx.post(f"{srv.url}/inference/v1/generate", json=body, headers={"X-Session-ID": session})
                assert resp.status_code == 200
        by_session = [{r["session"] for r in s} for s in seen]
        assert by_session[0] | by_session[1] == {"a", "b", "c"} and not by_session[0] & by_session[1]  # sticky
        assert by_session[0] and by_session[1]  # new sessions spread over both servers
        for s in seen:
            del s[:]
        for _ in range(4):  # no session: each request to the least busy, ties in turn
            assert httpx.post(f"{srv.url}/inference/v1/generate", json=body).status_code == 200
        assert [len(s) for s in seen] == [2, 2]
        srv.stop()
        assert not reported
        srv = ProxyServer([ups[0].url, dead], on_unreachable=lambda url, why: reported.append((url, why)))
        srv.start()
        codes = [
            httpx.post(f"{srv.url}/inference/v1/generate", json=body, headers={"X-Session-ID": s}).status_code
            for s in ("x", "y")
        ]
        assert codes == [200, 502]  # the first session went to the live server, the second to the dead one
        resp = httpx.post(f"{srv.url}/inference/v1/generate", json=body, headers={"X-Session-ID": "y"})
        assert resp.status_code == 502 and dead in resp.json()["error"]["message"]
    finally:
        srv.stop()
        for u in ups:
            u.stop()
    assert {url for url, _ in reported} == {dead} and "ConnectError" in reported[0][1]


@pytest.mark.parametrize(("over", "needle"), [
    ({"base_url": []}, "list of servers is empty"),
    ({"base_url": ["http://a:8000/v1", "http://a:8000/"]}, "more than once"),
    ({"base_url": ["http://a:8000", "a:8001"]}, r"inference.base_url\[1\] must start with http"),
    ({"base_url": "http://a:99999/v1"}, "not a valid URL"),
    ({"base_url": "http:///v1"}, "must be http"),
    ({"backend": "vllm", "base_url": ["http://a:1", "http://b:1"]}, 'needs backend = "external"'),
    ({"external": {"request_timeout_s": 0}}, "request_timeout_s"),
    ({"external": {"api_key": "short"}}, "api_key"),
    ({"external": {"server": "vllm", "weights_dir": "gs://b/w"}}, "vLLM servers load weights from a local path"),
])  # fmt: skip
def test_external_config_is_checked_when_loaded(over, needle) -> None:
    with pytest.raises(ValidationError, match=needle):
        InferenceConfig.model_validate({"backend": "external", "base_url": "http://a:8000/v1"} | over)
    ok = InferenceConfig(backend="external", base_url=["http://a:8000/v1", "https://b/"])
    assert ok.server_urls() == ["http://a:8000", "https://b"]


def test_multihost_rl_samples_from_the_colocated_engine_or_external_servers_never_a_launched_vllm(tmp_path) -> None:
    from jaxrl.cli import build_config

    rl = {"model": {"scratch": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 1,
                                "num_kv_heads": 1, "head_dim": 32, "max_position_embeddings": 64}},
          "trainer": {"seq_len": 64}, "orchestrator": {"train": {"env": [{"id": "reverse_text"}],
                                                                 "sampling": {"max_completion_tokens": 8}}},
          "distributed": {"enabled": True, "num_processes": 2, "process_id": 0, "coordinator_address": "h:1"}}  # fmt: skip
    assert build_config(rl, []).inference.backend.type == "embedded"  # colocated over the processes
    with pytest.raises(ValueError, match=r'inference.backend = "vllm" with several processes.*"external"'):
        build_config(rl | {"inference": {"backend": "vllm"}}, [])
    external = {"inference": {"backend": "external", "base_url": "http://h:8000"}}
    assert build_config(rl | external, []).inference.backend.type == "external"


def test_the_backend_is_a_union_on_type_and_the_older_shape_reads_the_same() -> None:
    from jaxrl.cli import build_config

    new = InferenceConfig.model_validate({"backend": {"type": "vllm", "python": "/p", "dtype": "float32"}})
    old = InferenceConfig.model_validate({"backend": "vllm", "vllm": {"python": "/p", "dtype": "float32"}})
    assert new == old and isinstance(new.backend, VLLMConfig) and new.backend.python == "/p"
    assert InferenceConfig().backend.type == "embedded"
    # A section of a backend other than the chosen one is refused, not ignored.
    with pytest.raises(ValidationError, match=r'inference.vllm: settings of the "vllm" backend, but the backend is '
                       r'"external"'):
        InferenceConfig.model_validate({"backend": "external", "base_url": "http://a:1", "vllm": {"python": "/p"}})
    with pytest.raises(ValidationError, match="extra_forbidden"):  # an external setting on the vLLM backend
        InferenceConfig.model_validate({"backend": {"type": "vllm", "server": "vllm"}})
    with pytest.raises(ValidationError, match="name the backend its settings are for"):
        InferenceConfig.model_validate({"backend": {"python": "/p"}})
    # Command line: the backend's type and its fields merge over the TOML (either shape), field by field.
    toml = {"inference": {"backend": "vllm", "vllm": {"python": "/p"}}}
    cfg = build_config(toml, ["--inference.backend.dtype", "bfloat16", "--inference.vllm.cpu_kv_cache_gib", "2"])
    assert (cfg.inference.backend.python, cfg.inference.backend.dtype, cfg.inference.backend.cpu_kv_cache_gib) == (
        "/p", "bfloat16", 2.0)
    cfg = build_config({}, ["--inference.backend", "external", "--inference.external.server", "vllm",
                            "--inference.base_url=http://a:1"])
    assert cfg.inference.backend.type == "external" and cfg.inference.backend.server == "vllm"
    cfg = build_config({}, ['--inference.backend={"type": "vllm", "dtype": "float32"}'])
    assert cfg.inference.backend.dtype == "float32"
