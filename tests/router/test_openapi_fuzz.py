"""Schemathesis against the live router's own OpenAPI document: every
operation it documents, with data that fits the document (positive) and
data that does not (negative). Checks: no 5xx, a documented status, an
answer conforming to the documented schema for its status (so errors too:
OpenAI's error object, or Anthropic's on /v1/messages), and a documented
content type.

The router runs in front of one fake engine (tests/router/fuzz_helpers.py).
A few examples per operation here; `make fuzz` runs many
(TANDEM_FUZZ_EXAMPLES)."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.timeout(900)
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "4"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    response_schema_conformance,
    content_type_conformance,
]
# What the router serves; the document must describe each (and no other).
OPERATIONS = {
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "GET /live",
    "GET /health",
    "GET /metrics",
}


@pytest.fixture(scope="module")
def router_schema(fuzz_router):
    schema = schemathesis.openapi.from_url(f"{fuzz_router.url}/openapi.json")
    schema.config.update(request_timeout=60)
    return schema


def test_the_document_lists_every_operation(fuzz_router):
    document = fuzz_router.client.get("/openapi.json").json()
    listed = {f"{m.upper()} {p}" for p, ops in document["paths"].items() for m in ops}
    assert listed == OPERATIONS
    for name, op in ((n, o) for ops in document["paths"].values() for n, o in ops.items()):
        assert "422" not in op["responses"], f"{name}: the router never answers 422"


# (Schemathesis' own pytest loader, `from_fixture`, fails under pytest 9:
# each operation and mode runs as a Hypothesis test here instead.)
# Negative data needs something to break: a request body (a GET's only
# parameter here, a path string, accepts anything).
RUNS = [(op, GenerationMode.POSITIVE) for op in sorted(OPERATIONS)] + [
    (op, GenerationMode.NEGATIVE) for op in sorted(OPERATIONS) if op.startswith("POST")
]


@pytest.mark.parametrize(("operation", "mode"), RUNS, ids=[f"{o} {m.value}" for o, m in RUNS])
def test_every_operation_answers_as_documented(router_schema, fuzz_router, operation, mode):
    method, path = operation.split(" ")
    api_operation = router_schema[path][method]
    tried = []

    @given(api_operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def answers_as_documented(case):
        tried.append(case)
        case.call_and_validate(checks=CHECKS)

    answers_as_documented()
    print(f"schemathesis {operation} {mode.value}: {len(tried)} examples")
    assert tried and fuzz_router.proc.alive()
