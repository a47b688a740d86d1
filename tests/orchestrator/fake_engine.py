"""A scripted model endpoint for tests: a real HTTP server on 127.0.0.1, no model.

It answers the routes verifiers' train client calls — `GET /v1/models` and
`POST /inference/v1/generate` (token-in/token-out, DESIGN contract 6) — by decoding the
prompt tokens back into chat messages and asking a test-supplied `policy` for the reply
text. Completion log-probs are a fixed function of the position (-0.01 * (i + 1)), so tests
can check that exact values reach the training samples. Every request (body + headers) is
recorded for assertions.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from transformers import AutoTokenizer

Policy = Callable[[list[dict]], str]
"""Chat messages ({role, content}) of the prompt -> the assistant reply text."""

_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>\n?|$)", re.DOTALL)


def parse_chatml(text: str) -> list[dict]:
    """ChatML text -> messages; the open assistant turn of a generation prompt is dropped."""
    messages = [{"role": r, "content": c} for r, c in _TURN.findall(text)]
    if messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return messages


def logprob_at(i: int) -> float:
    return -0.01 * (i + 1)


@dataclass
class FakeEngine:
    tokenizer_dir: str
    policy: Policy
    model: str = "tiny"
    max_model_len: int = 4096
    requests: list[dict] = field(default_factory=list)
    parse: Callable[[str], list[dict]] = parse_chatml
    """Prompt text -> chat messages (ChatML by default; other families pass their own)."""
    end_token: str = "<|im_end|>"
    """Appended to every reply: the family's end-of-turn token."""

    def __post_init__(self) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        self.end_id = self.tokenizer.convert_tokens_to_ids(self.end_token)
        app = FastAPI()
        app.get("/v1/models")(self._models)
        app.post("/inference/v1/generate")(self._generate)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("fake engine did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    async def _models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "max_model_len": self.max_model_len}],
        }

    async def _generate(self, request: Request) -> JSONResponse:
        body = await request.json()
        record = {"body": body, "headers": dict(request.headers)}
        self.requests.append(record)
        prompt = body["token_ids"]
        try:
            messages = self.parse(self.tokenizer.decode(prompt, skip_special_tokens=False))
            text = await asyncio.to_thread(self.policy, messages)  # a slow policy blocks no one
        except Exception as e:  # noqa: BLE001 - a failing policy is a provider error
            return JSONResponse({"error": {"message": f"policy failed: {e}"}}, status_code=500)
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.end_id]
        max_tokens = body["sampling_params"].get("max_tokens")
        finish = "stop"
        if max_tokens is not None and len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        record["answer"] = ids  # the completion token ids answered
        content = [
            {"token": f"token_id:{t}", "token_id": t, "logprob": logprob_at(i)} for i, t in enumerate(ids)
        ]
        return JSONResponse(
            {
                "request_id": f"req-{len(self.requests)}",
                "prompt_token_ids": prompt,
                "choices": [
                    {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": finish}
                ],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)},
            }
        )
