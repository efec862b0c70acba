"""Whatever JSON a client sends to the agent endpoints, the real router
process answers it — never a 5xx — and a refusal comes in that API's own
error format (Anthropic's on /v1/messages, OpenAI's elsewhere).

The router runs in front of one fake gRPC engine (tests/router/fuzz_helpers.py),
so bodies that pass validation are really tokenized, routed and generated;
Hypothesis writes the bodies from the keys and words these APIs use
(tests/helpers.py)."""

from __future__ import annotations

import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.router_fakes import MODEL_NAME
from tests.helpers import ANY_JSON, JSON_SCALARS
from tests.router.fuzz_helpers import check_answer

EXAMPLES = settings(
    max_examples=int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "60")),  # make fuzz: many
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def router(fuzz_router):
    return fuzz_router.client


def answered(client: httpx.Client, path: str, body: object) -> httpx.Response:
    """POST ``body``; the answer is not a 5xx, and a refusal is in the
    endpoint's own error format."""
    response = client.post(path, json=body)
    check_answer(path, response, body)
    return response


SMALL = st.integers(1, 8)  # keeps generated answers short where the body is valid

MESSAGES = st.fixed_dictionaries(
    {
        "model": st.just(MODEL_NAME),
        "max_tokens": SMALL | JSON_SCALARS,
        "messages": ANY_JSON | st.just([{"role": "user", "content": "hi"}]),
    },
    optional={
        "system": ANY_JSON,
        "tools": ANY_JSON,
        "tool_choice": ANY_JSON,
        "stream": st.booleans(),
        "stop_sequences": ANY_JSON,
        "metadata": ANY_JSON,
        "thinking": ANY_JSON,
        "temperature": JSON_SCALARS,
    },
)


@EXAMPLES
@given(MESSAGES)
def test_messages_never_5xx(router, body):
    answered(router, "/v1/messages", body)


@EXAMPLES
@given(MESSAGES)
def test_messages_count_tokens_never_5xx(router, body):
    body.pop("max_tokens", None)
    answered(router, "/v1/messages/count_tokens", body)


RESPONSES = st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "input": ANY_JSON | st.just("hi")},
    optional={
        "instructions": ANY_JSON,
        "tools": ANY_JSON,
        "tool_choice": ANY_JSON,
        "text": ANY_JSON,
        "stream": st.booleans(),
        "max_output_tokens": SMALL | JSON_SCALARS,
        "previous_response_id": JSON_SCALARS,
        "parallel_tool_calls": JSON_SCALARS,
    },
)


@EXAMPLES
@given(RESPONSES)
def test_responses_never_5xx(router, body):
    body.setdefault("max_output_tokens", 4)
    answered(router, "/v1/responses", body)


CHAT = st.fixed_dictionaries(
    {
        "model": st.just(MODEL_NAME),
        "messages": ANY_JSON | st.just([{"role": "user", "content": "hi"}]),
        "max_tokens": SMALL,
    },
    optional={
        "tools": ANY_JSON,
        "tool_choice": ANY_JSON,
        "response_format": ANY_JSON,
        "n": JSON_SCALARS,
        "logprobs": JSON_SCALARS,
        "top_logprobs": JSON_SCALARS,
        "seed": JSON_SCALARS,
        "stream": st.booleans(),
    },
)


@EXAMPLES
@given(CHAT)
def test_chat_with_agent_fields_never_5xx(router, body):
    answered(router, "/v1/chat/completions", body)


@EXAMPLES
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "model": JSON_SCALARS,
            "prompt": ANY_JSON,
            "messages": ANY_JSON,
            "tools": ANY_JSON,
            "add_special_tokens": JSON_SCALARS,
        },
    )
)
def test_tokenize_never_5xx(router, body):
    answered(router, "/tokenize", body)


@EXAMPLES
@given(
    st.fixed_dictionaries(
        {"tokens": ANY_JSON | st.lists(st.integers(-(2**40), 2**40))},
        optional={"model": JSON_SCALARS},
    )
)
def test_detokenize_never_5xx(router, body):
    answered(router, "/detokenize", body)
