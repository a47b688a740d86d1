"""The logic behind the generating endpoints (vLLM's ``serving`` layer; the routes are in
``server``, the bodies in ``protocol``): a request's sampling settings -> engine requests, awaiting
them, and the token-in/token-out (``/inference/v1/generate``) and text (``/v1/completions``)
responses. ``chat`` builds the chat endpoint on the same ``CompletionServing``."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import numpy as np

from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Completion, TokenDelta
from jaxrl.engine.requests import Request as EngineRequest
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.serving import protocol
from jaxrl.serving.errors import BadRequest, Unavailable


def make_stop_fn(tokenizer: Any, stops: list[str]) -> Callable[[list[int]], bool]:
    """True once the decoded completion tail contains a stop string."""
    width = 4 * max(len(s) for s in stops) + 8  # tokens enough to hold any stop string

    def stop(tokens: list[int]) -> bool:
        tail = tokenizer.decode(tokens[-width:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    return stop


def stop_strings(body: protocol.SamplingFields) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def routed_experts_payload(c: Completion, start: int) -> dict[str, Any] | None:
    """``protocol.RoutedExperts`` of positions ``start`` on (None when the request was aborted
    before any forward pass). ``data`` first: renderers finds the base64 string by its prefix
    ``"routed_experts":{"data":"`` in the raw body and never JSON-decodes it."""
    if c.routed_experts is None:
        return None
    rows = np.ascontiguousarray(c.routed_experts[start:])
    return {
        "data": base64.b64encode(rows.tobytes()).decode("ascii"),
        "shape": list(rows.shape),
        "start": start,
        "dtype": str(rows.dtype),
    }


def usage(prompt_len: int, completions: list[Completion]) -> dict[str, Any]:
    out = sum(len(c.token_ids) for c in completions)
    cached = min(c.cached_prompt_tokens for c in completions)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": out,
        "total_tokens": prompt_len + out,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ChoiceStream:
    """The tokens of a streamed request's choices, handed from the engine thread to the event
    loop as they are sampled. The engine side only schedules a queue put on the loop
    (``call_soon_threadsafe``): a slow reader never holds the engine loop up, it just finds
    more tokens waiting. Reading stops early (the client went away: the handler is cancelled)
    aborts the choices still running, which frees their cache rows."""

    def __init__(self, engine: Engine, n: int):
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, TokenDelta | Future[Completion]]] = asyncio.Queue()
        self._reqs: list[EngineRequest] = []
        self._n = n

    def on_tokens(self, choice: int, delta: TokenDelta) -> None:  # engine thread
        self._put((choice, delta))

    def _put(self, item: tuple[int, TokenDelta | Future[Completion]]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop closed (server shut down): nobody reads any more
            pass

    def watch(self, reqs: list[EngineRequest], futures: list[Future[Completion]]) -> None:
        self._reqs = reqs
        for i, f in enumerate(futures):  # the engine streams a choice's tokens before completing it
            f.add_done_callback(partial(lambda i, f: self._put((i, f)), i))

    async def events(self) -> AsyncIterator[list[tuple[int, list[TokenDelta], Completion | None]]]:
        """Batches of (choice, new token deltas, its completion once done): everything that
        arrived since the last batch, so a reader that falls behind catches up in one step."""
        running = set(range(self._n))
        try:
            while running:
                items = [await self._queue.get()]
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                batch: dict[int, tuple[list[TokenDelta], Completion | None]] = {}
                for i, item in items:
                    deltas, _ = batch.setdefault(i, ([], None))
                    if isinstance(item, TokenDelta):
                        deltas.append(item)
                    else:
                        running.discard(i)
                        batch[i] = (deltas, item.result())  # an engine failure raises here
                yield [(i, deltas, done) for i, (deltas, done) in batch.items()]
        finally:
            for i in running:  # the reader stopped early: free the rows
                self._engine.abort(self._reqs[i].request_id)


class CompletionServing:
    """Runs requests on ``engine`` and shapes what the generating endpoints answer."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_name: str,
        default_stop_ids: Sequence[int],
        return_routed_experts: bool = False,
    ):
        if return_routed_experts and not engine.arch.is_moe:
            raise ValueError(
                "inference.server.return_routed_experts = true needs a mixture-of-experts model; this one is dense"
            )
        self.return_routed_experts = return_routed_experts
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_stop_ids = list(default_stop_ids)

    def top_logprobs(self, field: str, n: int | None) -> int:
        """``n`` top log-probs asked for by request field ``field`` (None: 0), within the server's
        cap (``inference.backend.max_logprobs``, what its schema publishes as the maximum)."""
        cap = self.engine.max_logprobs
        if n is not None and n > cap:
            raise BadRequest(
                f"{field}: at most {cap} on this server (inference.backend.max_logprobs), got {n}: ask for {cap} or fewer"
            )
        return n or 0

    def params(
        self, body: protocol.SamplingFields, prompt_len: int, max_tokens: int | None, top_logprobs: int = 0
    ) -> list[SamplingParams]:
        """Engine sampling settings of a request's ``n`` choices. Like vLLM, a prompt plus
        ``max_tokens`` beyond ``max_model_len`` is refused rather than silently cut short.
        ``top_logprobs``: from ``top_logprobs`` (checked against the cap)."""
        limit = self.engine.max_model_len
        if max_tokens is None:
            max_tokens = max(limit - prompt_len, 1)  # a too-long prompt is refused by the engine
        elif prompt_len + max_tokens > limit:
            raise BadRequest(
                f"max_tokens: this model's maximum context length is {limit} tokens; the request asks for "
                f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for the completion): "
                f"lower max_tokens to at most {max(limit - prompt_len, 0)} or shorten the prompt"
            )
        stop_ids = list(body.stop_token_ids or []) + ([] if body.ignore_eos else self.default_stop_ids)
        seeds = [None] * body.n if body.seed is None else [body.seed + i for i in range(body.n)]
        try:
            return [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    top_k=body.top_k or 0,
                    seed=seed,
                    stop_token_ids=tuple(dict.fromkeys(stop_ids)),
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty,
                    top_logprobs=top_logprobs,
                )
                for seed in seeds
            ]
        except ValueError as e:
            raise BadRequest(str(e)) from None

    def submit(
        self,
        prompt: list[int],
        params: list[SamplingParams],
        session: str | None,
        stops: list[str],
        on_tokens: Callable[[int, TokenDelta], None] | None = None,
    ) -> tuple[list[EngineRequest], list[Future[Completion]]]:
        """One engine request per choice; a request the engine refuses is a 400 (503 when the
        engine cannot take requests) and takes back the choices already submitted.
        ``on_tokens(choice, delta)``: streaming (``Request.on_tokens``, on the engine thread)."""
        stop_fn = make_stop_fn(self.tokenizer, stops) if stops else None
        reqs = [
            EngineRequest(
                prompt, p, session_id=session, stop_fn=stop_fn,
                on_tokens=None if on_tokens is None else partial(on_tokens, i),
            )
            for i, p in enumerate(params)
        ]  # fmt: skip
        futures: list[Future[Completion]] = []
        try:
            for r in reqs:
                futures.append(self.engine.submit(r))
        except (ValueError, RuntimeError) as e:
            for r in reqs[: len(futures)]:
                self.engine.abort(r.request_id)
            raise (BadRequest if isinstance(e, ValueError) else Unavailable)(str(e)) from None
        return reqs, futures

    async def complete(
        self, prompt: list[int], params: list[SamplingParams], session: str | None, stops: list[str]
    ) -> list[Completion]:
        """Submit one engine request per choice and await them all; a cancelled handler (client
        gone, shutdown) aborts its requests."""
        reqs, futures = self.submit(prompt, params, session, stops)
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except asyncio.CancelledError:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise

    def stream(
        self, prompt: list[int], params: list[SamplingParams], session: str | None, stops: list[str]
    ) -> ChoiceStream:
        """Submit the choices now (a refused request is an error answer, not a stream) and
        return what reads their tokens as the engine samples them."""
        events = ChoiceStream(self.engine, len(params))
        reqs, futures = self.submit(prompt, params, session, stops, events.on_tokens)
        events.watch(reqs, futures)
        return events

    def visible(self, c: Completion, stops: list[str]) -> tuple[list[int], str]:
        """Completion tokens and text as a client sees them: without the matched stop token,
        the text cut before a matched stop string."""
        ids = c.token_ids
        if c.stop_token is not None:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        return ids, text if cut < 0 else text[:cut]

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def text_logprobs(
        self, ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]], offset: int = 0
    ) -> dict[str, Any]:
        """A completion choice's ``logprobs`` (OpenAI's legacy shape, as vLLM fills it) for tokens
        ``ids`` whose text starts at character ``offset``: ``top_logprobs`` per token maps the
        most likely tokens' text, and the sampled token's, to their log-probs (None when the
        request asks for none: ``logprobs: 0``)."""
        pieces = [self.piece(t) for t in ids]
        starts = [offset + sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
        tops = None
        if top:
            tops = []
            for piece, lp, entries in zip(pieces, logprobs, top):
                d = {self.piece(t): v for t, v in entries}
                d.setdefault(piece, lp)
                tops.append(d)
        return {"tokens": pieces, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": starts}

    # -- /inference/v1/generate ----------------------------------------------------------------

    async def generate(self, body: protocol.GenerateRequest, session: str | None) -> dict[str, Any]:
        sp = body.sampling_params
        params = self.params(sp, len(body.token_ids), sp.max_tokens)
        routing_start = self._routing_start(sp, len(body.token_ids))
        completions = await self.complete(body.token_ids, params, session, stop_strings(sp))
        choices = []
        for i, c in enumerate(completions):
            logprobs = None
            if sp.logprobs is not None:
                content = [
                    {"token": f"token_id:{t}", "token_id": t, "logprob": lp} for t, lp in zip(c.token_ids, c.logprobs)
                ]
                logprobs = {"content": content}
            choices.append(
                {
                    "index": i,
                    "token_ids": c.token_ids,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "policy_version": c.policy_version,
                    "policy_version_final": c.policy_version_final,
                    "token_versions": c.token_versions,
                }
            )
            if routing_start is not None:
                choices[-1]["routed_experts"] = routed_experts_payload(c, routing_start)
        return {
            "request_id": body.request_id or f"gen-{uuid.uuid4().hex}",
            "prompt_token_ids": body.token_ids,
            "choices": choices,
            "usage": usage(len(body.token_ids), completions),
        }

    def _routing_start(self, sp: protocol.GenerateSamplingParams, prompt_len: int) -> int | None:
        """The first position whose routing the response carries; None: no routing asked for."""
        asked = self.return_routed_experts if sp.return_routed_experts is None else sp.return_routed_experts
        if not asked:
            return None
        if not self.engine.arch.is_moe:
            raise BadRequest("sampling_params.return_routed_experts: the served model is dense (it routes no experts)")
        start = sp.routed_experts_prompt_start or 0
        if start > prompt_len:
            raise BadRequest(
                f"sampling_params.routed_experts_prompt_start = {start} exceeds the prompt's {prompt_len} tokens"
            )
        return start

    # -- /v1/completions -----------------------------------------------------------------------

    def text_request(self, body: protocol.CompletionRequest) -> tuple[list[int], list[SamplingParams], list[str]]:
        prompt = body.prompt if isinstance(body.prompt, list) else self.tokenizer.encode(body.prompt)
        top = self.top_logprobs("logprobs", body.logprobs)
        return prompt, self.params(body, len(prompt), body.max_tokens, top), stop_strings(body)

    async def completions(self, body: protocol.CompletionRequest, session: str | None) -> dict[str, Any]:
        prompt, params, stops = self.text_request(body)
        done = await self.complete(prompt, params, session, stops)
        choices = []
        for i, c in enumerate(done):
            ids, text = self.visible(c, stops)
            logprobs = None
            if body.logprobs is not None:
                logprobs = self.text_logprobs(ids, c.logprobs[: len(ids)], c.top_logprobs[: len(ids)])
            choices.append(
                {"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason, "token_ids": c.token_ids}
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(len(prompt), done),
        }
