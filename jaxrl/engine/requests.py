"""What the engine is asked and what it answers: a ``Request``, its ``Sequence`` (the
scheduler's state of it while it runs), the ``TokenDelta`` streamed per device call and the
``Completion`` it ends with. Pure host-side data; the HTTP layer, the scheduler and the engine
all speak it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxrl.engine.token_sampling import SamplingParams


@dataclass
class Request:
    """One generation request (one completion; ``n`` completions are ``n`` requests)."""

    prompt: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    session_id: str | None = None
    stop_fn: Callable[[list[int]], bool] | None = None
    """Extra host-side stop test on the completion so far (e.g. stop strings); True = stop."""
    on_tokens: Callable[[TokenDelta], None] | None = None
    """Streaming: called on the engine thread after each device call that sampled tokens for this
    request, with those tokens, before the request's future completes. It must return at once
    (hand the delta to another thread: the engine loop waits for it); what it raises is logged
    and the request goes on."""


@dataclass(frozen=True)
class TokenDelta:
    """Completion tokens sampled by one engine device call (a prefill's first token, or up to
    ``decode_steps`` decode tokens), with their log-probs and the weights version that drew them."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per token, when the request asks (``SamplingParams.top_logprobs``): its most likely
    (token id, log-prob) pairs, most likely first; else empty."""


@dataclass
class Completion:
    """The result of one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # completion tokens, the matched stop token included
    logprobs: list[float]  # one per completion token (see jaxrl.engine.token_sampling)
    finish_reason: str  # "stop" | "length" | "abort"
    policy_version: int  # weights version that sampled the first completion token
    policy_version_final: int  # ... and the last (differs only with weight_update = "immediate")
    cached_prompt_tokens: int  # prompt tokens whose keys/values came from the prefix cache
    stop_token: int | None = None  # the stop token id that ended the completion (its last token)
    routed_experts: np.ndarray | None = None
    """MoE models: uint8/uint16 [prompt + completion - 1, n_moe_layers, k], the experts each fed
    token used per sparse layer (the last completion token is never fed); None for dense ones."""
    token_versions: list[int] = field(default_factory=list)
    """The weights version that sampled each completion token (``weight_update = "immediate"``
    swaps weights between engine steps, so one completion can span versions)."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per completion token, when the request asks (``SamplingParams.top_logprobs``): the most
    likely (token id, log-prob) pairs of the distribution it was drawn from, most likely first
    (``jaxrl.engine.token_sampling.sample_with_top``); else empty."""


class Sequence:
    """Scheduler state of one request."""

    def __init__(self, request: Request, seed: int, max_model_len: int):
        self.request = request
        self.params = request.params
        self.seed = seed
        self.prompt = np.asarray(request.prompt, np.int32)
        self.max_new = min(self.params.max_tokens, max_model_len - len(self.prompt))
        self.stop_ids = frozenset(self.params.stop_token_ids)
        self.row = -1
        self.prefilled = 0  # prompt tokens whose keys/values are in the row
        self.cached_prompt = 0  # of which came from the prefix cache
        self.fed = 0  # completion tokens whose keys/values are in the row
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # the weights version that sampled each token
        self.top: list[list[tuple[int, float]]] = []  # top log-probs of each token (when asked)
        self.finish_reason: str | None = None
        self.stop_token: int | None = None
        self.routing: list[np.ndarray] = []  # chunks of routing records of the row's positions, in order
        self.arrival = time.monotonic()  # submitted: the start of its time to first token and latency

    def routed_experts(self) -> np.ndarray | None:
        """The routing records of the positions this sequence's row holds (None: none recorded)."""
        if not self.routing:
            return None
        if len(self.routing) > 1:
            self.routing = [np.concatenate(self.routing)]
        return self.routing[0]

    def record_routing(self, experts: np.ndarray) -> None:
        """Append the routing of positions just written to the row (``[n, n_moe_layers, k]``; a
        dense model's are empty and not kept)."""
        if experts.size:
            self.routing.append(experts)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def position(self) -> int:
        """Next cache position to write."""
        return self.prefilled + self.fed

    def cached_tokens(self) -> np.ndarray:
        """Tokens whose keys/values this sequence's row holds, in position order."""
        done = np.asarray(self.tokens[: self.fed], np.int32)
        return np.concatenate([self.prompt[: self.prefilled], done])

    def append(
        self, token: int, logprob: float, version: int, top: tuple[np.ndarray, np.ndarray] | None = None
    ) -> bool:
        """Record a sampled token (``top``: the most likely tokens' ids and log-probs, kept as far
        as the request asks); returns True when the sequence is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if self.params.top_logprobs and top is not None:
            n = self.params.top_logprobs
            self.top.append([(int(t), float(lp)) for t, lp in zip(top[0][:n], top[1][:n])])
        stop_fn = self.request.stop_fn
        if token in self.stop_ids:
            self.finish_reason, self.stop_token = "stop", token
        elif stop_fn is not None and stop_fn(self.tokens):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def completion(self, version: int) -> Completion:
        """The result so far (``version``: the one served, for a request aborted before its first token)."""
        first, last = (self.versions[0], self.versions[-1]) if self.versions else (version, version)
        return Completion(
            request_id=self.request.request_id,
            prompt_token_ids=list(self.request.prompt),
            token_ids=list(self.tokens),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "abort",
            policy_version=first,
            policy_version_final=last,
            cached_prompt_tokens=self.cached_prompt,
            stop_token=self.stop_token,
            routed_experts=self.routed_experts(),
            token_versions=list(self.versions),
            top_logprobs=list(self.top),
        )
