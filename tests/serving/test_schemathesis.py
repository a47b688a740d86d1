"""Property-based fuzzing of the live HTTP API from its own ``/openapi.json`` (schemathesis):
generated requests, valid and invalid, over real HTTP to a real server; none may get a 5xx, and
every request the schema calls valid is accepted (schemathesis' ST202), except for the few
cross-field rules a schema cannot state (``BEYOND_THE_SCHEMA``).

Bounded and repeatable: ``MAX_EXAMPLES`` per operation, derandomized with a fixed seed. The
server is small (max_model_len 64) so a generated ``max_tokens`` or ``n`` cannot make one case slow.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, seed, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance
from transformers import AutoTokenizer

from jaxrl.engine.engine import Engine
from jaxrl.serving.server import EngineServer

MAX_EXAMPLES = 40
pytestmark = pytest.mark.slow  # fuzzing every route: the slow tier
STATUS = Counter()


@pytest.fixture(scope="module")
def live_server(model_dir, tokenizer_dir, make_config):
    engine = Engine.from_pretrained(model_dir, make_config(max_model_len=64))
    srv = EngineServer(engine, AutoTokenizer.from_pretrained(tokenizer_dir), model_name="tiny")
    srv.start()
    yield srv
    srv.stop()
    total = sum(STATUS.values())
    print(f"\nschemathesis: {total} requests; status counts {dict(sorted(STATUS.items()))}")


@pytest.fixture(scope="module")
def api_schema(live_server):
    return schemathesis.openapi.from_url(live_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@seed(20261123)
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_generated_request_gets_a_server_error(case, live_server) -> None:
    response = case.call(timeout=120)
    STATUS[response.status_code] += 1
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    )
    assert live_server.engine.healthy
    if response.status_code == 400 and _beyond_the_schema(case, response.json()["error"]["message"]):
        return
    case.validate_response(response, checks=[positive_data_acceptance])


# The rules no JSON schema can state, each answered with a 400 naming the field (as vLLM does):
# everything else the server refuses, its schema (``protocol.server_schema``) refuses too (ST202).
BEYOND_THE_SCHEMA = {
    # exactly one weights source; a manifest's own structure and what it names (endpoints, params)
    "/update_weights": ("exactly one of path", "timeout_s: only with manifest", "manifest:", "update_weights:"),
    "/inference/v1/generate": ("maximum context length",),  # prompt + max_tokens
    "/v1/completions": ("maximum context length", "max_model_len", "stream_options: only with stream"),
    "/v1/chat/completions": (
        "maximum context length",
        "stream_options: only with stream",
        "max_model_len",
        "the chat template failed",  # the template's own rules on the messages
        "the rendered prompt has over",
        "top_logprobs: only with logprobs",
    ),
}


def _beyond_the_schema(case, message: str) -> bool:
    return any(needle in message for needle in BEYOND_THE_SCHEMA.get(case.path, ()))
