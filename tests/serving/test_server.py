"""A live server on loopback, driven by the real clients: renderers' generate, openai, httpx."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI, OpenAI
from renderers import Qwen3RendererConfig, create_renderer
from renderers.client import generate
from transformers import AutoTokenizer

from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Completion, TokenDelta
from jaxrl.engine.requests import Request as EngineRequest
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.models.hf_io import load_decoder
from jaxrl.serving import protocol
from jaxrl.serving.chat import ChatServing, parse_tool_calls, renderer_tool_calls
from jaxrl.serving.server import EngineServer
from jaxrl.serving.streaming import chat_chunks

MAX_LEN = 1024


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def server(model_dir, tokenizer, make_config):
    # Room for a chat prompt with tool definitions (~570 byte-level tokens).
    engine = Engine.from_pretrained(model_dir, make_config(max_model_len=MAX_LEN))
    srv = EngineServer(engine, tokenizer, model_name="tiny")
    srv.start(progress=WARMUP_LINES.append)
    yield srv
    srv.stop()
    assert not engine.running  # the server started the engine, so it stopped it


WARMUP_LINES: list[str] = []
"""What the module's server's warm-up reported (``jaxrl.serve`` prints each on stderr)."""


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
    turn of a conversation is served from the prefix cache and ``GET /metrics.json`` counts it."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        before = client.get("/metrics.json").json()
        assert before["compiles"] == before["program_bound"] == server.engine.config.program_bound() > 2
        assert before["warmup_s"] > 0
    # One line per program as it compiles: a big model's warm-up takes minutes and must not look hung.
    n = before["program_bound"]
    assert WARMUP_LINES[0].startswith(f"warm-up: compiling {n} programs")
    done = [re.fullmatch(rf"compiled (.+) \((\d+)/{n}\) in \d+\.\d s", line) for line in WARMUP_LINES[1:]]
    assert all(done) and [int(m.group(2)) for m in done] == list(range(1, n + 1)), WARMUP_LINES
    names = " ".join(WARMUP_LINES)
    assert "compiled prefill batch=" in names and "compiled decode steps=" in names and "row copy" in names
    with httpx.Client(base_url=server.url, timeout=120) as client:

        def generate(prompt: list[int], max_tokens: int) -> dict:
            body = {"model": "tiny", "token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "seed": 3}}
            resp = client.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "metrics"})
            assert resp.status_code == 200, resp.text
            return resp.json()

        first_prompt = [5 + i % 200 for i in range(150)]  # > one prefill chunk; decode past 128
        first = generate(first_prompt, 8)
        second_prompt = first_prompt + first["choices"][0]["token_ids"] + [7, 8, 9]
        second = generate(second_prompt, 4)
        after = client.get("/metrics.json").json()
    assert after["compiles"] == before["compiles"]  # nothing compiled after healthy
    assert after["prompt_tokens"] - before["prompt_tokens"] == len(first_prompt) + len(second_prompt)
    reused = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    assert reused == len(second_prompt) - 3 - 1  # all but the new tokens (and the last old one)
    generated = sum(len(r["choices"][0]["token_ids"]) for r in (first, second))
    assert after["generated_tokens"] - before["generated_tokens"] == generated
    assert 0 < after["prefix_hit_rate"] <= 1 and after["waiting"] == 0 and after["running"] == 0
    assert after["tokens_per_s"] > 0 and after["decode_calls"] > before["decode_calls"]


def _scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``GET /metrics`` parsed by prometheus_client's own parser: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def test_metrics_are_prometheus_text_that_counts_requests_tokens_and_first_token_times(server, tokenizer) -> None:
    """``GET /metrics`` is what vLLM serves there (Prometheus text, vLLM's names): after two
    generate requests and one bad one, the counters moved by exactly what the answers say, and
    the time-to-first-token histogram counts each request once. A second server in the same
    process counts its own HTTP answers (its own registry), not the first's."""
    from prometheus_client import REGISTRY

    tiny = (("model_name", "tiny"),)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        before = _scrape(client)
        outs = []
        for prompt, max_tokens in (([5, 6, 7, 8], 3), ([9, 10], 5)):
            body = {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "seed": 1, "ignore_eos": True}}
            resp = client.post("/inference/v1/generate", json=body)
            assert resp.status_code == 200, resp.text
            outs.append(resp.json())
        assert client.post("/inference/v1/generate", json={"token_ids": []}).status_code == 400
        after = _scrape(client)

    def moved(name: str, labels: tuple[tuple[str, str], ...] = tiny) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("vllm:prompt_tokens_total") == 4 + 2
    assert moved("vllm:generation_tokens_total") == 3 + 5 == sum(len(o["choices"][0]["token_ids"]) for o in outs)
    assert moved("vllm:request_success_total", (("finished_reason", "length"), *tiny)) == 2
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert 0 < moved("vllm:time_to_first_token_seconds_sum") <= moved("vllm:e2e_request_latency_seconds_sum")
    assert after[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"), *tiny))] == after[
        ("vllm:time_to_first_token_seconds_count", tiny)
    ]
    generate = "/inference/v1/generate"
    assert moved("jaxrl:http_requests_total", (("route", generate), ("status", "200"))) == 2
    assert moved("jaxrl:http_requests_total", (("route", generate), ("status", "400"))) == 1
    assert after[("vllm:num_requests_running", tiny)] == after[("vllm:num_requests_waiting", tiny)] == 0
    assert after[("jaxrl:policy_version", tiny)] == server.engine.policy_version
    assert after[("jaxrl:compiled_programs", tiny)] == server.engine.config.program_bound()

    other = EngineServer(server.engine, tokenizer, model_name="other")  # the engine runs: only HTTP starts
    other.start()
    try:
        with httpx.Client(base_url=other.url, timeout=30) as client:
            theirs = _scrape(client)
    finally:
        other.stop()
    assert server.engine.running  # the second server did not own the engine
    assert ("jaxrl:http_requests_total", (("route", generate), ("status", "200"))) not in theirs
    assert theirs[("vllm:generation_tokens_total", (("model_name", "other"),))] >= after[
        ("vllm:generation_tokens_total", tiny)
    ]  # the engine's counters are the engine's, served under this server's model name
    assert REGISTRY.get_sample_value("jaxrl:http_requests_total", {"route": generate, "status": "200"}) is None


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
    protocol.ChatCompletionResponse.model_validate(raw.http_response.json())
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
    protocol.CompletionResponse.model_validate(raw.http_response.json())
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
    assert content == "Let me check.\n"  # only the call is taken out (vLLM's Hermes parser)
    assert [c["function"] for c in calls] == [{"name": "lookup_weather", "arguments": '{"city": "Oslo"}'}]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_a_call_the_renderer_cannot_parse_stays_in_the_content(tokenizer) -> None:
    """The run's renderer path keeps a broken call visible, as the Hermes fallback above does
    (a policy closing its call with one brace too many must show up in its rollouts' record)."""
    renderer = create_renderer(tokenizer, Qwen3RendererConfig(enable_thinking=False))
    good, broken = '{"name": "lookup", "arguments": {"key": "ab"}}', '{"name": "lookup", "arguments": {"key": "cd"}}}'
    text = f"ok <tool_call>\n{good}\n</tool_call>\n<tool_call>\n{broken}\n</tool_call><|im_end|>"
    parsed = renderer.parse_response(tokenizer.encode(text, add_special_tokens=False))
    content, calls = renderer_tool_calls(parsed)
    assert content == f"ok\n{broken}"
    assert [c["function"] for c in calls] == [{"name": "lookup", "arguments": '{"key": "ab"}'}]
    only_broken = renderer.parse_response(tokenizer.encode(f"<tool_call>\n{broken}\n</tool_call>", add_special_tokens=False))
    assert renderer_tool_calls(only_broken) == (broken, [])


OUT_OF_RANGE = [
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 1e-46}, "top_p"),  # positive, but 0 in float32
    ({"top_p": 0}, "top_p"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1e39}, "temperature"),  # inf in float32
    ({"seed": 2**63}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"min_p": 2}, "min_p"),
    ({"min_p": 0.1}, "min_p"),  # not implemented: refused, never ignored
    ({"min_tokens": 3}, "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),  # vLLM's ranges
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),  # positive, but 0 in float32
    ({"top_p": 5e-324}, "top_p"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"n": 0}, "n"),
]


def sampling_cases() -> list[tuple[str, dict, str]]:
    """Each out-of-range sampling value on each generating endpoint."""
    cases = []
    for sampling, field in OUT_OF_RANGE:
        cases.append(
            (
                "/inference/v1/generate",
                {"token_ids": [1, 2], "sampling_params": sampling},
                f"sampling_params.{field}",
            )
        )
        cases.append(
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **sampling}, field)
        )
        cases.append(("/v1/completions", {"prompt": "x", **sampling}, field))
    return cases


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
    ("/inference/v1/generate", {"token_ids": [1, True]}, "token_ids[1]"),
    ("/inference/v1/generate", {"token_ids": "abc"}, "token_ids"),
    ("/inference/v1/generate", {}, "token_ids: required"),
    ("/inference/v1/generate", [1, 2], "request body"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    # Strict fields: a boolean is true / false, never 0 or "yes" (the schema says boolean).
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"logprobs": False}}, "sampling_params.logprobs"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos"),
    ("/v1/completions", {"prompt": [1], "stream": 0}, "stream: should be a valid boolean, got 0"),
    ("/v1/completions", {"prompt": [1], "max_tokens": "3"}, "max_tokens"),
    ("/v1/completions", {"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options: only with stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "return_token_ids": "yes"},
     "return_token_ids: should be a valid boolean"),
    # What needs constrained decoding is refused in one line saying why, not accepted and ignored.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}},
     'tool_choice: "auto" or "none" only: a named or "required" tool choice needs constrained decoding'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     'response_format: {"type": "text"} only: JSON output'),
    ("/v1/completions", {"prompt": [1, -3]}, "vocabulary"),
    ("/update_weights", {}, "exactly one of path (a model directory) or manifest (a weight manifest), not neither"),
    ("/update_weights", {"path": "x", "manifest": {}}, "exactly one of path (a model directory) or manifest"),
    ("/update_weights", {"manifest": {"version": 1, "endpoints": []}}, "manifest: not a weight manifest"),
    # Every sampling value is range-checked before it reaches the engine thread (a top_k of 2**31
    # once overflowed an int32 array there and left the server answering 503 for good).
    *sampling_cases(),
    (
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"logprobs": 21}},
        "sampling_params.logprobs",
    ),
    # no top log-probs on this endpoint: a count above 1 is refused, not ignored
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"logprobs": 2}}, "sampling_params.logprobs"),
    (
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"seed": 2**63 - 512, "n": 2}},
        "sampling_params.seed",  # beyond the range JSON readers agree on (seed + i always fits)
    ),
    # prompt + max_tokens over max_model_len: refused as vLLM does, not silently cut short
    (
        "/inference/v1/generate",
        {"token_ids": [1] * 10, "sampling_params": {"max_tokens": MAX_LEN - 9}},
        "maximum context length is 1024",
    ),
    ("/v1/completions", {"prompt": [1] * (MAX_LEN - 8)}, "max_tokens: this model's maximum context length"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        "text",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
        "text",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "type"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
        "top_logprobs",
    ),
    ("/update_weights", {"path": "x", "version": 2**70}, "version"),
    ("/update_weights", {"path": "/tmp/a\x00b"}, "path: a non-empty string with no NUL byte"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs: only with logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": -(2**63)}, "seed"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2, "max_tokens": MAX_LEN},
        "max_tokens: at most 1023",
    ),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD)
def test_bad_requests_get_400_naming_the_problem(server, path, body, message) -> None:
    content = (
        body if isinstance(body, str) else json.dumps(body)
    )  # NaN / Infinity as Python clients send them
    r = httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


READABLE = [
    ("/v1/completions", {"prompt": ["a"]},
     "prompt: expected a string or a list of integers, got ['a'] (prompt[0] should be a valid integer, got 'a')"),
    ("/v1/completions", {"prompt": [[1, 2]]}, "prompt: expected a string or a list of integers"),
    ("/v1/completions", {"prompt": 5}, "prompt: expected a string or a list of integers, got 5"),
    ("/v1/completions", {"prompt": ""}, "prompt: string should have at least 1 character"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop: expected a string or a list of strings, got [1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content: expected a string or a list of ContentPart objects"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content: expected a string"),
    ("/inference/v1/generate", {"token_ids": [1, "a"]}, "token_ids[1]: should be a valid integer, got 'a'"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"stop_token_ids": [1.5]}},
     "sampling_params.stop_token_ids[0]: should be a valid integer"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "message"), READABLE)
def test_validation_errors_name_the_field_as_written_without_pydantic_internals(server, path, body, message) -> None:
    """A 400 once read ``prompt.list[function-before[_json_integer(), int]].0: Input should be a
    valid integer``: pydantic's union tags and dotted indices. It names the field as the client
    wrote it and what the field takes, in words."""
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    text = r.json()["error"]["message"]
    assert text.startswith(message), text
    for internal in ("function-", "constrained-", "list[", "Input should", ".0", ".1", "union", "[int", "str]"):
        assert internal not in text, text


def test_streamed_chat_and_completions_match_the_whole_answers(server) -> None:
    """``stream: true`` through the openai client's streaming API: server-sent chunks whose
    concatenation is the non-streamed answer (same seed), finish reasons, and the usage in one
    last chunk when ``stream_options.include_usage`` asks (vLLM's and OpenAI's shape)."""
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Say something."}]
    common = {"model": "tiny", "messages": messages, "max_completion_tokens": 8, "seed": 11, "n": 2}
    whole = client.chat.completions.create(**common, logprobs=True)
    chunks = list(client.chat.completions.create(**common, logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: the second run hits the cache
    assert chunks[-1].choices == [] and [getattr(chunks[-1].usage, k) for k in counts] == [
        getattr(whole.usage, k) for k in counts
    ]
    assert all(c.usage is None for c in chunks[:-1])
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == (choice.message.content or "")
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        streamed = [e.logprob for c in mine if c.logprobs for e in c.logprobs.content]
        assert streamed == [e.logprob for e in choice.logprobs.content]

    prompt = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 6, "seed": 5, "extra_body": {"ignore_eos": True}}
    text = client.completions.create(**prompt)
    pieces = list(client.completions.create(**prompt, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text.choices[0].text and text.choices[0].text
    assert [p.choices[0].finish_reason for p in pieces if p.choices[0].finish_reason] == ["length"]
    assert all(p.usage is None for p in pieces)  # not asked for: no usage chunk
    raw = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True}, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = raw.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    streamed = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-2]]
    assert sum(len(c["token_ids"]) for c in streamed) == 2 and streamed[-1]["finish_reason"] == "length"


def _gate_decode(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold the engine thread after each decode call until the returned event is set: what a
    client receives before that was sent while the answer was still being generated."""
    gate, decode = threading.Event(), engine._run_decode

    def gated(plan):  # type: ignore[no-untyped-def]
        decode(plan)
        gate.wait(60)

    monkeypatch.setattr(engine, "_run_decode", gated)
    return gate


def test_streams_token_by_token_and_a_gone_client_frees_its_row(server, monkeypatch) -> None:
    """Chunks leave as the engine samples: the first content chunk arrives while the engine is
    held after its first decode call (so max_tokens is far), and the deltas add up to the
    non-streamed answer (same seed). A client that goes away mid-stream aborts its request: the
    engine stops generating for it and its row is free."""
    engine = server.engine
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    common = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "seed": 3, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**common).choices[0].text
    gate = _gate_decode(engine, monkeypatch)
    before = engine.stats.generated_tokens
    with client.completions.create(**common, stream=True) as stream:
        pieces = iter(stream)
        first = next(p for p in pieces if p.choices[0].text)
        assert engine.stats.generated_tokens - before <= 1 + engine.config.decode_steps  # still far from 400
        gate.set()
        text = first.choices[0].text + "".join(p.choices[0].text for p in pieces)
    assert text == whole

    gate.clear()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Go on."}], "max_completion_tokens": 400,
            "seed": 4, "stream": True, "extra_body": {"ignore_eos": True}}  # fmt: skip
    before = engine.stats.generated_tokens
    with client.chat.completions.create(**chat) as stream:
        next(c for c in stream if c.choices and c.choices[0].delta.content)  # then the client leaves
    deadline = time.monotonic() + 60
    while not engine._aborts and time.monotonic() < deadline:  # the server saw the client go
        time.sleep(0.01)
    gate.set()
    while engine.metrics().running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.metrics().running == 0, "the request of the gone client still runs"
    assert engine.stats.generated_tokens - before <= 1 + 2 * engine.config.decode_steps  # aborted, not run to 400


class _ScriptedTokens:
    """The reading side of ``ChoiceStream`` over scripted tokens, one per batch (the engine's side
    is tested above): the chunk builder sees text a random tiny model would never write."""

    def __init__(self, ids: list[int], done: Completion):
        self.ids, self.done = ids, done

    async def events(self):  # type: ignore[no-untyped-def]
        for t in self.ids:
            yield [(0, [TokenDelta([t], [-0.5], [0])], None)]
        yield [(0, [], self.done)]


@pytest.mark.parametrize("with_renderer", [True, False])
def test_streamed_reasoning_content_and_tool_calls_add_up_to_the_answer(server, tokenizer, with_renderer) -> None:
    """Token by token, with the run's renderer (reasoning, then content, then a tool call) and with
    the tokenizer's template and a stop string: the deltas of each field concatenate to the
    non-streamed choice, content streams before the end, and the call comes whole, once."""
    chat = ChatServing(server.completion, renderer={"name": "qwen3"}) if with_renderer else server.chat
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    if with_renderer:
        text = '<think>\nlet me think</think>\n\nHello world <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        extra, stops = {"tools": tools}, []
    else:
        text, extra, stops = " Hello, wide world! And more", {"stop": ["world!"]}, ["world!"]
    ids = tokenizer.encode(text, add_special_tokens=False) + [end]
    body = protocol.ChatCompletionRequest(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, logprobs=True, **extra
    )
    done = Completion("r", [1], ids, [-0.5] * len(ids), "stop", 0, 0, 0, stop_token=end, token_versions=[0] * len(ids))
    renderer = chat._chat_renderer({}) if with_renderer else None
    final = chat.choice(0, done, stops, body, renderer, [1])

    async def collect() -> list[dict]:
        return [c async for c in chat_chunks(chat, _ScriptedTokens(ids, done), body, [1], renderer, stops)]

    chunks = [c["choices"][0] for c in asyncio.run(collect())]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["delta"] for c in chunks[1:]]
    for field in ("reasoning_content", "content"):
        assert "".join(d.get(field, "") for d in deltas) == (final["message"].get(field) or "")
    assert final["message"]["content"] and sum(1 for d in deltas[:-2] if d.get("content")) >= 3  # streamed, not whole
    calls = [[{k: v for k, v in call.items() if k != "id"} for call in d["tool_calls"]] for d in deltas if "tool_calls" in d]
    assert calls == ([[{"index": 0, "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]] if with_renderer else [])
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == [final["finish_reason"]]
    logprobs = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert logprobs == final["logprobs"]["content"]


def test_tool_choice_none_leaves_a_written_call_as_text(server, tokenizer) -> None:
    """tool_choice "none" is honoured, not ignored: the same completion (a call the model wrote)
    is a tool call under "auto" (and by default) and stays text under "none"."""
    from jaxrl.engine.requests import Completion

    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    done = Completion("r", [1], ids, [-0.5] * len(ids), "stop", 0, 0, 0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]

    def answer(**kw) -> dict:
        body = protocol.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                              "tools": tools, **kw})  # fmt: skip
        return server.chat.choice(0, done, [], body)

    for auto in (answer(), answer(tool_choice="auto")):
        assert auto["finish_reason"] == "tool_calls" and auto["message"]["content"] == "Sure.\n"  # as written
        assert [c["function"]["name"] for c in auto["message"]["tool_calls"]] == ["f"]
    none = answer(tool_choice="none")
    assert none["finish_reason"] == "stop" and "tool_calls" not in none["message"]
    assert none["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)  # the call as text


def test_the_schema_names_only_the_template_kwargs_the_renderer_takes(server) -> None:
    from jaxrl.models.renderer import template_kwarg_names

    def kwargs_schema(**kw) -> list[dict]:
        schema = {"components": {"schemas": {
            name: {"properties": {"stop_token_ids": {}, "max_tokens": {}, "chat_template_kwargs": {
                "anyOf": [{"type": "object"}, {"type": "null"}]}}}
            for name in ("GenerateSamplingParams", "ChatCompletionRequest", "CompletionRequest")
        } | {"GenerateRequest": {"properties": {"token_ids": {}}}}}}  # fmt: skip
        schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"] = {}
        out = protocol.server_schema(schema, vocab_size=10, max_model_len=16, **kw)
        return out["components"]["schemas"]["ChatCompletionRequest"]["properties"]["chat_template_kwargs"]["anyOf"]

    qwen3 = template_kwarg_names({"name": "qwen3", "enable_thinking": False})
    assert "enable_thinking" in qwen3
    narrowed = kwargs_schema(allow_request_chat_template=False, template_kwargs=qwen3)[0]
    assert narrowed["propertyNames"] == {"enum": sorted(qwen3)}
    assert kwargs_schema(allow_request_chat_template=False, template_kwargs=frozenset())[0]["maxProperties"] == 0
    assert "enum" not in kwargs_schema(allow_request_chat_template=False)[0]["propertyNames"]  # any but reserved
    # The live server here renders with the tokenizer's template: any key but the reserved ones.
    assert server.chat.template_kwarg_names() is None
    live = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]
    names = next(v for v in live["properties"]["chat_template_kwargs"]["anyOf"] if v.get("type") == "object")
    assert names["propertyNames"] == {"not": {"enum": [*protocol.RESERVED_TEMPLATE_KWARGS, "chat_template"]}}


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
    protocol.GenerateResponse.model_validate(out)
    assert out["prompt_token_ids"] == [1, 2] and out["usage"]["completion_tokens"] == 2
    assert out["choices"][0]["logprobs"] is None and out["choices"][0]["finish_reason"] == "length"
    assert httpx.get(server.url + "/nope").status_code == 404
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_penalties_are_applied_not_ignored(server) -> None:
    """Penalties over HTTP reach the engine: the greedy completion changes, and matches the engine's
    own with the same penalties (whose numerics ``test_engine`` checks against numpy)."""
    prompt = [5, 6, 7, 5, 6, 7, 8]
    penalties = {"repetition_penalty": 1.7, "frequency_penalty": 0.9, "presence_penalty": 0.4}

    def post(extra: dict) -> dict:
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 16, "temperature": 0, "logprobs": 0, **extra}}
        r = httpx.post(server.url + "/inference/v1/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    plain, penalised = post({}), post(penalties)
    assert plain["token_ids"] != penalised["token_ids"]
    want = server.engine.submit(
        EngineRequest(prompt, SamplingParams(max_tokens=16, temperature=0, **penalties))
    ).result(120)
    assert penalised["token_ids"] == want.token_ids
    got = [e["logprob"] for e in penalised["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(got, want.logprobs)) < 1e-5


def _local_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_engine_step_failure_fails_its_batch_and_keeps_serving(server) -> None:
    """A request that breaks an engine step (here: a top_k that overflows the int32 sampling
    array, smuggled past validation) fails with the requests of its batch; the engine thread
    lives on, /health stays ok, the 500 keeps the keep-alive connection open, and the next
    request on that connection succeeds."""
    engine = server.engine
    params = SamplingParams(max_tokens=4)
    object.__setattr__(params, "top_k", 2**31)  # what the API and SamplingParams now refuse
    killer = EngineRequest([1, 2, 3], params)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        result: dict[str, httpx.Response] = {}
        body = {"token_ids": [4, 5, 6], "sampling_params": {"max_tokens": 600, "ignore_eos": True}}

        def call() -> None:
            result["r"] = client.post("/inference/v1/generate", json=body)

        before = engine.stats.generated_tokens
        thread = threading.Thread(target=call)
        thread.start()
        _wait_for_tokens(engine, before)
        failed = engine.submit(killer)
        with pytest.raises(RuntimeError, match="engine step failed.*OverflowError"):
            failed.result(timeout=120)
        thread.join()
        in_batch = result["r"]
        assert in_batch.status_code == 500 and "engine step failed" in in_batch.json()["error"]["message"]
        assert in_batch.headers.get("connection") != "close"
        assert engine.healthy and engine.running
        assert client.get("/health").json()["status"] == "ok"
        after = client.post(
            "/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}
        )
        assert after.status_code == 200 and len(after.json()["choices"][0]["token_ids"]) == 3
        assert _local_port(after) == _local_port(in_batch)  # the same pooled connection


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
        protocol.GenerateResponse.model_validate(r.json())
        choice = r.json()["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == 60
        assert choice["policy_version"] == choice["policy_version_final"]
        assert choice["token_versions"] == [choice["policy_version"]] * 60  # drain: one version per answer
        versions.append(choice["policy_version"])
    assert 0 in versions  # some were in flight during the update, and finished on the old weights
    assert after.json()["choices"][0]["policy_version"] == 1
    assert bad.status_code == 404 and "not a model directory" in bad.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json()["policy_version"] == 1


def test_update_weights_refuses_a_broken_directory_with_400(server, model_dir, tmp_path) -> None:
    """A directory that does not load is the client's error: 400 (404 when the path names no
    model directory at all: a well-formed request for what is not there), the old weights keep
    serving, and the connection stays open."""
    import shutil

    not_a_config = tmp_path / "list_config"
    not_a_config.mkdir()
    (not_a_config / "config.json").write_text("[]")
    truncated = tmp_path / "truncated"
    shutil.copytree(model_dir, truncated)
    shard = next(truncated.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    version = server.engine.policy_version
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for path, status, needle in (
            (not_a_config, 400, "cannot load"),
            (truncated, 400, "cannot load"),
            (tmp_path / "missing", 404, "not a model directory"),
            (model_dir / "config.json", 404, "not a model directory"),
        ):
            r = client.post("/update_weights", json={"path": str(path)})
            assert r.status_code == status and needle in r.json()["error"]["message"], r.text
            assert r.headers.get("connection") != "close"
        assert client.get("/health").json()["policy_version"] == version


def test_405_names_the_allowed_methods_and_openapi_documents_400(server) -> None:
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = httpx.post(server.url + "/health")
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    schema = httpx.get(server.url + "/openapi.json").json()
    for path in ("/inference/v1/generate", "/v1/chat/completions", "/v1/completions", "/update_weights"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and "400" in responses
    assert "ErrorResponse" in schema["components"]["schemas"]
    # Which distribution the log-probs are of, and this server's own limits, are in the schema.
    assert "after the request's penalties" in schema["info"]["description"]
    defs = schema["components"]["schemas"]
    token_ids = defs["GenerateRequest"]["properties"]["token_ids"]
    vocab = server.engine.vocab_size
    assert token_ids["maxItems"] == MAX_LEN - 1 and token_ids["items"]["maximum"] == vocab - 1
    assert defs["ChatCompletionRequest"]["properties"]["chat_template"] == {
        "type": "null", "description": "request-supplied chat templates are off on this server"
    }


def test_update_weights_needs_the_api_key(model_dir, tokenizer, make_config, tmp_path) -> None:
    engine = Engine.from_pretrained(model_dir, make_config(max_model_len=64))
    srv = EngineServer(engine, tokenizer, api_key="k" * 20, weights_root=tmp_path)
    srv.start()
    try:
        body = {"path": str(model_dir)}
        assert httpx.post(srv.url + "/update_weights", json=body).status_code == 401
        wrong = {"authorization": "Bearer " + "x" * 20}
        r = httpx.post(srv.url + "/update_weights", json=body, headers=wrong)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        right = {"authorization": "Bearer " + "k" * 20}
        r = httpx.post(srv.url + "/update_weights", json=body, headers=right)
        assert (
            r.status_code == 403 and "outside the allowed weights directory" in r.json()["error"]["message"]
        )
        # A URL (shared storage of an external rollout backend) is refused under a local root.
        r = httpx.post(srv.url + "/update_weights", json={"path": "gs://bucket/w/policy-1"}, headers=right)
        assert r.status_code == 403 and "outside the allowed weights directory" in r.json()["error"]["message"]
        generate = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
        assert httpx.post(srv.url + "/inference/v1/generate", json=generate, timeout=120).status_code == 200
    finally:
        srv.stop()
    # Under a URL root only URLs below it pass (reading one needs the bucket: not exercised here).
    srv = EngineServer(engine, tokenizer, weights_root="gs://bucket/w/")
    srv.start()
    try:
        for path in (str(model_dir), "gs://bucket/other/p", "gs://bucket/w/../x"):
            r = httpx.post(srv.url + "/update_weights", json={"path": path})
            assert r.status_code == 403 and "outside the allowed" in r.json()["error"]["message"], path
    finally:
        srv.stop()
    # Bound to a non-loopback address with no key configured: a key is generated, never an open route.
    assert EngineServer(engine, tokenizer, host="0.0.0.0").api_key
    assert EngineServer(engine, tokenizer, host="127.0.0.1").api_key is None


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SLOW_TEMPLATE = "{% for a in range(500) %}{% for b in range(500) %}{% for c in range(500) %}{% endfor %}{% endfor %}{% endfor %}"


def test_request_chat_templates_are_off_by_default(server) -> None:
    for body in (
        {**CHAT, "chat_template": "{{ 'x' }}"},
        {**CHAT, "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}},
    ):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "allow_request_chat_template" in r.json()["error"]["message"]


def test_allowed_request_templates_render_in_a_budgeted_sandbox(server, tokenizer) -> None:
    srv = EngineServer(
        server.engine, tokenizer, allow_request_chat_template=True, request_template_timeout_s=1.0
    )
    srv.start()  # the engine runs already: this server only adds the HTTP front
    try:
        plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}{{ greeting }}"
        body = {
            **CHAT,
            "chat_template_kwargs": {"chat_template": plain, "greeting": "!"},
            "return_token_ids": True,
        }
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"] == tokenizer.encode(
            "hi" + tokenizer.eos_token + "!", add_special_tokens=False
        )

        async def slow_render_and_health():  # type: ignore[no-untyped-def]
            done: list[str] = []
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:

                async def call(name: str, coro):  # type: ignore[no-untyped-def]
                    response = await coro
                    done.append(name)
                    return response

                slow = asyncio.create_task(
                    call(
                        "slow", c.post("/v1/chat/completions", json={**CHAT, "chat_template": SLOW_TEMPLATE})
                    )
                )
                await asyncio.sleep(0.2)
                health = await call("health", c.get("/health"))
                return await slow, health, done

        slow, health, done = asyncio.run(slow_render_and_health())
        assert health.status_code == 200 and done == ["health", "slow"]  # the event loop never stalled
        assert slow.status_code == 400 and "longer than 1 s" in slow.json()["error"]["message"]
        for template, needle in (
            ("{{ 'a' * 1000000000 }}", "memory"),  # grows the child, never the server
            ("{% for i in range(100000) %}{{ 'abcdefgh' * 100 }}{% endfor %}", "exceeds"),
            ("{{ raise_exception('no system prompt') }}", "no system prompt"),
            ("{% for %}", "TemplateSyntaxError"),
        ):
            r = httpx.post(
                srv.url + "/v1/chat/completions", json={**CHAT, "chat_template": template}, timeout=60
            )
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    finally:
        srv.stop()


def _reference_top(model, prompt: list[int], completion: list[int], temperature: float, k: int) -> list[list[tuple[int, float]]]:
    """Per completion token, the ``k`` most likely (id, log-prob) of log_softmax(logits / T) from
    the trainer's full forward (no cache), in numpy."""
    seq = np.asarray(prompt + completion, np.int32)
    hidden, _ = model(seq[None], np.arange(len(seq))[None])
    logits = np.asarray(hidden[0], np.float64) @ np.asarray(model.lm_head_weight(), np.float64)
    rows = logits[len(prompt) - 1 : len(seq) - 1] / temperature
    logp = rows - rows.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    order = np.argsort(-logp, axis=-1, kind="stable")[:, :k]
    return [[(int(i), float(row[i])) for i in ids] for row, ids in zip(logp, order)]


def test_top_logprobs_are_the_models_most_likely_tokens(server, tokenizer, model_dir, other_model_dir) -> None:
    """Chat ``top_logprobs`` and completions' ``logprobs: k`` return the k most likely tokens of
    the distribution each token was drawn from (numpy over the trainer's forward), the sampled
    token's log-prob equal to its own entry; streamed entries equal the whole answer's."""
    piece = lambda t: tokenizer.decode([t])
    chat_body = {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0.7, "seed": 5,
        "logprobs": True, "top_logprobs": 20, "return_token_ids": True, "ignore_eos": True,
    }  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=120) as client:
        r = client.post("/v1/chat/completions", json=chat_body)
        assert r.status_code == 200, r.text
        chat = r.json()
        protocol.ChatCompletionResponse.model_validate(chat)
        ids, entries = chat["choices"][0]["token_ids"], chat["choices"][0]["logprobs"]["content"]
        served = {0: model_dir, 1: other_model_dir}[server.engine.policy_version]  # after the update test: 1
        model = load_decoder(served)
        everything = _reference_top(model, chat["prompt_token_ids"], ids, 0.7, server.engine.vocab_size)
        want = [ref[:20] for ref in everything]
        for t, entry, ref, full in zip(ids, entries, want, everything, strict=True):
            top = entry["top_logprobs"]
            np.testing.assert_allclose([e["logprob"] for e in top], [v for _, v in ref], atol=1e-4)
            for e in top:  # each entry is a token with that log-prob (near-ties may swap ranks)
                assert any(piece(i) == e["token"] and abs(v - e["logprob"]) < 1e-4 for i, v in full), e
                assert e["bytes"] == list(e["token"].encode())
            mine = [e for e in top if e["token"] == piece(t) and abs(e["logprob"] - entry["logprob"]) < 1e-4]
            if t in [i for i, _ in ref]:  # the sampled token's value is its entry's, bit for bit
                assert any(e["logprob"] == entry["logprob"] for e in mine), (entry, top)
        assert any(t in [i for i, _ in ref] for t, ref in zip(ids, want))  # some sampled token is in its top k

        with client.stream("POST", "/v1/chat/completions", json={**chat_body, "stream": True}) as resp:
            lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        streamed = [e for c in map(json.loads, lines) for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
        assert streamed == entries

        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        protocol.CompletionResponse.model_validate(r.json())
        want = _reference_top(model, [5, 6, 7], choice["token_ids"], 1.0, 2)
        for t, lp, top, ref in zip(choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"], want, strict=True):
            assert t == ref[0][0]  # greedy: the most likely token
            assert top[piece(t)] == lp and set(top) <= {piece(i) for i, _ in ref} | {piece(t)}
            np.testing.assert_allclose(sorted(top.values(), reverse=True), [v for _, v in ref][: len(top)], atol=1e-4)
        plain = client.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]
        assert plain["logprobs"]["top_logprobs"] is None and plain["token_ids"] == choice["token_ids"]


def test_chat_content_is_the_text_of_its_tokens(server, tokenizer) -> None:
    """Content keeps its whitespace (an all-whitespace answer is that whitespace, not null); the
    renderer's reasoning and tool-call parsing take out only what they parse, as vLLM's parsers
    do; and over HTTP the content is the decode of the returned token ids, special tokens skipped."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    qwen3 = ChatServing(server.completion, renderer={"name": "qwen3"})
    renderer = qwen3._chat_renderer({})
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    cases = [  # (completion text, content with the renderer, content without)
        ("\n\n  \n", "\n\n  \n", "\n\n  \n"),
        ("  Hello\n\n", "  Hello\n\n", "  Hello\n\n"),
        ("<think>\nhm</think>\n\n Hi \n", "\n\n Hi \n", "\nhm\n\n Hi \n"),
        ("<think>\nhm</think>\n\n", "\n\n", "\nhm\n\n"),
        (f" Sure. \n{call}", " Sure. \n", " Sure. \n"),
        (f"\n{call}", "\n", "\n"),  # vLLM's Hermes parser: the text before the call, null only if empty
        (call, None, None),
    ]
    for text, with_renderer, without in cases:
        ids = tokenizer.encode(text, add_special_tokens=False) + [end]
        done = Completion("r", [1], ids, [-0.5] * len(ids), "stop", 0, 0, 0, stop_token=end)
        body = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
        assert qwen3.choice(0, done, [], body, renderer, [1])["message"]["content"] == with_renderer, text
        assert server.chat.choice(0, done, [], body)["message"]["content"] == without, text
    plain = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    done = Completion("r", [1], [end], [-0.5], "stop", 0, 0, 0, stop_token=end)
    assert server.chat.choice(0, done, [], plain)["message"]["content"] == ""  # an empty answer: "", as vLLM

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "n": 4, "seed": 2, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        ids = choice["token_ids"][:-1] if choice["finish_reason"] == "stop" else choice["token_ids"]
        assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_published_limits_are_the_enforced_ones(server) -> None:
    """Each bound /openapi.json publishes for a chat request's integer fields is enforced: the
    bound itself is accepted and one past it is a 400 naming the field."""
    schema = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]
    base = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1, "logprobs": True}
    for field in ("seed", "max_tokens", "max_completion_tokens", "top_logprobs", "top_k", "n"):
        (bounds,) = [v for v in schema["properties"][field].get("anyOf", [schema["properties"][field]]) if v.get("type") == "integer"]
        for edge, step in (("minimum", -1), ("maximum", 1)):
            if edge not in bounds:
                continue
            value = bounds[edge]
            if field in ("max_tokens", "max_completion_tokens") and edge == "maximum":
                value = 1  # the largest that fits the prompt is not the schema's concern: its +1 is
            elif field == "n" and edge == "maximum":
                value = 2  # keep the accepted case small
            ok = httpx.post(server.url + "/v1/chat/completions", json={**base, field: value}, timeout=120)
            assert ok.status_code == 200, (field, value, ok.text)
            assert isinstance(bounds[edge], int), (field, bounds)  # exact: no double rounding of 2**63 - 513
            r = httpx.post(server.url + "/v1/chat/completions", json={**base, field: bounds[edge] + step}, timeout=60)
            assert r.status_code == 400, (field, bounds[edge] + step, r.text)
            assert r.json()["error"]["message"].startswith(field), r.text
