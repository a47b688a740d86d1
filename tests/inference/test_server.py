"""A live server on loopback, driven by the real clients: renderers' generate, openai, httpx."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from renderers import Qwen3RendererConfig, create_renderer
from renderers.client import generate
from transformers import AutoTokenizer

from jaxrl.inference import api
from jaxrl.inference.engine import Engine
from jaxrl.inference.server import EngineServer, parse_tool_calls
from jaxrl.models.hf_io import load_decoder

MAX_LEN = 1024


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def server(model_dir, tokenizer, make_config):
    # Room for a chat prompt with tool definitions (~570 byte-level tokens).
    engine = Engine.from_pretrained(model_dir, make_config(max_model_len=MAX_LEN, decode_len_buckets=[128]))
    srv = EngineServer(engine, tokenizer, model_name="tiny")
    srv.start()
    yield srv
    srv.stop()
    assert not engine.running  # the server started the engine, so it stopped it


def _wait_for_tokens(engine: Engine, before: int) -> None:
    deadline = time.monotonic() + 60
    while engine.stats.generated_tokens == before and time.monotonic() < deadline:
        time.sleep(0.002)


def test_renderers_generate_two_turns(server, tokenizer, model_dir, score, kl) -> None:
    renderer = create_renderer(tokenizer, Qwen3RendererConfig(enable_thinking=False))
    messages = [{"role": "user", "content": "Reverse the text: abc"}]
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 1}
    headers = {"X-Session-ID": "rollout-1"}

    async def run() -> tuple[dict, dict]:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
        first = await generate(
            client=client,
            renderer=renderer,
            messages=messages,
            model="tiny",
            sampling_params=sampling,
            extra_headers=headers,
        )
        follow_up = "<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
        prompt2 = (
            first["prompt_ids"]
            + first["completion_ids"]
            + tokenizer.encode(follow_up, add_special_tokens=False)
        )
        second = await generate(
            client=client,
            renderer=renderer,
            messages=[],
            prompt_ids=prompt2,
            model="tiny",
            sampling_params=sampling,
            extra_headers=headers,
        )
        await client.close()
        return first, second

    first, second = asyncio.run(run())
    assert first["prompt_ids"] == renderer.render_ids(messages, add_generation_prompt=True)
    model = load_decoder(model_dir)
    for out in (first, second):
        assert 0 < len(out["completion_ids"]) == len(out["completion_logprobs"]) <= 12
        assert out["finish_reason"] in ("stop", "length")
        assert out["request_id"]
        assert (
            kl(score(model, out["prompt_ids"], out["completion_ids"], 1.0), out["completion_logprobs"])
            <= 1e-6
        )
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(first["prompt_ids"]) + len(first["completion_ids"]) - 1


def test_warm_up_compiles_every_program_and_metrics_count_prefix_hits(server) -> None:
    """The server reports healthy only after the warm-up compiled every bucket's program, so
    requests of any shape (chunked prefill, both decode lengths) compile nothing more; the second
    turn of a conversation is served from the prefix cache and ``GET /metrics`` counts it."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        before = client.get("/metrics").json()
        assert before["compiles"] == before["program_bound"] == server.engine.config.program_bound() > 2
        assert before["warmup_s"] > 0

        def generate(prompt: list[int], max_tokens: int) -> dict:
            body = {"model": "tiny", "token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "seed": 3}}
            resp = client.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "metrics"})
            assert resp.status_code == 200, resp.text
            return resp.json()

        first_prompt = [5 + i % 200 for i in range(150)]  # > one prefill chunk; decode past 128
        first = generate(first_prompt, 8)
        second_prompt = first_prompt + first["choices"][0]["token_ids"] + [7, 8, 9]
        second = generate(second_prompt, 4)
        after = client.get("/metrics").json()
    assert after["compiles"] == before["compiles"]  # nothing compiled after healthy
    assert after["prompt_tokens"] - before["prompt_tokens"] == len(first_prompt) + len(second_prompt)
    reused = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    assert reused == len(second_prompt) - 3 - 1  # all but the new tokens (and the last old one)
    generated = sum(len(r["choices"][0]["token_ids"]) for r in (first, second))
    assert after["generated_tokens"] - before["generated_tokens"] == generated
    assert 0 < after["prefix_hit_rate"] <= 1 and after["waiting"] == 0 and after["running"] == 0
    assert after["tokens_per_s"] > 0 and after["decode_calls"] > before["decode_calls"]


def test_openai_chat_completions_and_models(server, tokenizer) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    card = client.models.list().data[0]
    assert card.id == "tiny" and card.model_extra["max_model_len"] == MAX_LEN
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup_weather",
                "description": "Weather for a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
        ],
        max_completion_tokens=6,
        n=2,
        seed=3,
        logprobs=True,
        tools=tools,
        extra_body={"return_token_ids": True, "top_k": 50, "cache_salt": "ignored"},
    )
    api.ChatCompletionResponse.model_validate(raw.http_response.json())
    chat = raw.parse()
    assert len(chat.choices) == 2
    for choice in chat.choices:
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        ids = choice.model_extra["token_ids"]
        assert 0 < len(ids) <= 6
        assert len(choice.logprobs.content) == len(ids) - (choice.finish_reason == "stop")
        assert all(entry.logprob <= 0 for entry in choice.logprobs.content)
    assert chat.choices[0].model_extra["token_ids"] != chat.choices[1].model_extra["token_ids"]
    prompt_ids = chat.model_extra["prompt_token_ids"]
    assert "lookup_weather" in tokenizer.decode(prompt_ids) and chat.usage.prompt_tokens == len(prompt_ids)


def test_openai_completions_with_stop_string(server, tokenizer) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    full = client.completions.create(
        model="tiny", prompt=[1, 2, 3], max_tokens=16, seed=4, extra_body={"ignore_eos": True}
    )
    ids = full.choices[0].model_extra["token_ids"]
    assert len(ids) == 16 and full.choices[0].finish_reason == "length"
    k = next(
        i
        for i in range(1, 16)
        if (p := tokenizer.decode([ids[i]])).isascii()
        and p.isprintable()
        and p not in tokenizer.decode(ids[:i])
    )
    stop = tokenizer.decode([ids[k]])
    raw = client.completions.with_raw_response.create(
        model="tiny",
        prompt=[1, 2, 3],
        max_tokens=16,
        seed=4,
        stop=[stop],
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    api.CompletionResponse.model_validate(raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "stop" and choice.text == tokenizer.decode(ids[:k])
    assert len(choice.logprobs.token_logprobs) == k + 1  # generation stopped at the token completing it
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert text.usage.prompt_tokens == 5 and text.usage.completion_tokens <= 3


def test_parse_tool_calls() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "lookup_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"] for c in calls] == [{"name": "lookup_weather", "arguments": '{"city": "Oslo"}'}]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


BAD = [
    ("/inference/v1/generate", '{"token_ids": [1, 2', "malformed JSON"),
    ("/inference/v1/generate", {"token_ids": [1, 10_000]}, "token_ids[1] = 10000 is outside the vocabulary"),
    ("/inference/v1/generate", {"token_ids": [1] * MAX_LEN}, "max_model_len"),
    (
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
        "sampling_params.max_tokens",
    ),
    (
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"temperature": -1}},
        "sampling_params.temperature",
    ),
    ("/inference/v1/generate", {"token_ids": [1, True]}, "token_ids.1"),
    ("/inference/v1/generate", {"token_ids": "abc"}, "token_ids"),
    ("/inference/v1/generate", {}, "token_ids: Field required"),
    ("/inference/v1/generate", [1, 2], "request body"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
    ("/v1/completions", {"prompt": [1, -3]}, "vocabulary"),
    ("/update_weights", {}, "path: Field required"),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD)
def test_bad_requests_get_400_naming_the_problem(server, path, body, message) -> None:
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, str)
        else {"json": body}
    )
    r = httpx.post(server.url + path, timeout=60, **kw)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_unknown_fields_are_ignored_and_server_stays_healthy(server) -> None:
    body = {
        "model": "whatever",
        "token_ids": [1, 2],
        "cache_salt": "x",
        "priority": 3,
        "routed_experts_prompt_start": 0,
        "output_mode": "tokens",
        "sampling_params": {
            "max_tokens": 2,
            "skip_special_tokens": False,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
        },
    }
    r = httpx.post(server.url + "/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200
    out = r.json()
    api.GenerateResponse.model_validate(out)
    assert out["prompt_token_ids"] == [1, 2] and out["usage"]["completion_tokens"] == 2
    assert out["choices"][0]["logprobs"] is None and out["choices"][0]["finish_reason"] == "length"
    assert httpx.get(server.url + "/nope").status_code == 404
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_shutdown_lets_requests_in_flight_finish(server, tokenizer) -> None:
    engine = server.engine
    extra = EngineServer(engine, tokenizer, model_name="tiny")  # the engine runs already: not ours to stop
    extra.start()
    result: dict[str, httpx.Response] = {}
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 100, "ignore_eos": True}}

    def call() -> None:
        result["r"] = httpx.post(extra.url + "/inference/v1/generate", json=body, timeout=120)

    before = engine.stats.generated_tokens
    thread = threading.Thread(target=call)
    thread.start()
    _wait_for_tokens(engine, before)
    extra.stop()
    thread.join()
    assert result["r"].status_code == 200 and len(result["r"].json()["choices"][0]["token_ids"]) == 100
    with pytest.raises(httpx.ConnectError):
        httpx.get(extra.url + "/health")
    assert engine.running and httpx.get(server.url + "/health").status_code == 200


def test_update_weights_over_http_loses_no_request(server, other_model_dir) -> None:
    """Runs last: it changes the served weights."""
    engine = server.engine

    async def run():  # type: ignore[no-untyped-def]
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            before = engine.stats.generated_tokens
            body = lambda i: {
                "token_ids": [2, 7, i],
                "sampling_params": {"max_tokens": 60, "seed": i, "logprobs": 1, "ignore_eos": True},
            }
            tasks = [asyncio.create_task(c.post("/inference/v1/generate", json=body(i))) for i in range(6)]
            while engine.stats.generated_tokens == before:
                await asyncio.sleep(0.002)
            update = await c.post("/update_weights", json={"path": str(other_model_dir)})
            results = await asyncio.gather(*tasks)
            after = await c.post(
                "/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
            )
            bad = await c.post("/update_weights", json={"path": str(other_model_dir / "missing")})
            return update, results, after, bad

    update, results, after, bad = asyncio.run(run())
    assert update.status_code == 200 and update.json() == {"policy_version": 1}
    versions = []
    for r in results:
        assert r.status_code == 200
        api.GenerateResponse.model_validate(r.json())
        choice = r.json()["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == 60
        assert choice["policy_version"] == choice["policy_version_final"]
        versions.append(choice["policy_version"])
    assert 0 in versions  # some were in flight during the update, and finished on the old weights
    assert after.json()["choices"][0]["policy_version"] == 1
    assert bad.status_code == 400 and "update_weights" in bad.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json()["policy_version"] == 1
