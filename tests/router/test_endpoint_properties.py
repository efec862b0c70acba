"""Whatever JSON a client sends to the agent endpoints, the real router
process answers it — never a 5xx — and a refusal comes in that API's own
error format (Anthropic's on /v1/messages, OpenAI's elsewhere).

The router (``python -m services.router``, tool parsing on) runs in front of
one fake gRPC engine (bench/router_fakes.py), so bodies that pass validation
are really tokenized, routed and generated; Hypothesis writes the bodies from
the keys and words these APIs use (tests/helpers.py)."""

from __future__ import annotations

import os
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.router_fakes import MODEL_NAME
from common.model import resolve_model
from common.ports import free_port
from common.procs import Processes, wait_grpc_serving, wait_http_ok
from services.router.chat_templates import CHATML_TOOLS
from tests.helpers import ANY_JSON, JSON_SCALARS

HOST = "127.0.0.1"
STARTUP_S = 120.0
EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    procs = Processes(tmp_path_factory.mktemp("endpoint-properties"))
    cpus = set(os.sched_getaffinity(0))
    model_dir = str(resolve_model(None))
    try:
        engine_port, port = free_port(), free_port()
        fake, _ = procs.launch(
            "fake-engine",
            [
                sys.executable,
                "-m",
                "bench.router_fakes",
                "grpc",
                "--host",
                HOST,
                "--port",
                str(engine_port),
                "--model-path",
                model_dir,
                "--token-text",
                "ok",
            ],
            cpus,
        )
        wait_grpc_serving(f"{HOST}:{engine_port}", fake, time.monotonic() + STARTUP_S)
        proc, _ = procs.launch(
            "router",
            [
                sys.executable,
                "-m",
                "services.router",
                "--host",
                HOST,
                "--port",
                str(port),
                "--engine",
                f"{HOST}:{engine_port}",
                "--model",
                model_dir,
                "--chat-template",
                str(CHATML_TOOLS),
                "--tool-call-parser",
                "hermes",
            ],
            cpus,
        )
        url = f"http://{HOST}:{port}"
        wait_http_ok(f"{url}/health", proc, time.monotonic() + STARTUP_S)
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client
    finally:
        procs.stop_all()


def answered(client: httpx.Client, path: str, body: object) -> httpx.Response:
    """POST ``body``; the answer is not a 5xx, and a refusal is in the
    endpoint's own error format."""
    response = client.post(path, json=body)
    assert response.status_code < 500, f"{path} {body!r}: {response.status_code} {response.text}"
    if response.status_code >= 400:
        error = response.json()
        if path.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["message"], error
        else:
            assert error["error"]["message"] and error["error"]["type"], error
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
