"""Property tests of the Messages and Responses translations: whatever JSON a
client sends, validation and translation either succeed or refuse with the
error that becomes a 400 (pydantic's ValidationError, or a ValueError naming
the field) — never another exception, which would be a 500. No engines."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.router.api.messages import translate as messages
from services.router.api.messages.protocol import MessagesRequest
from services.router.api.responses import translate as responses
from services.router.api.responses.protocol import ResponsesRequest
from tests.helpers import ANY_JSON as JSON
from tests.helpers import JSON_SCALARS as SCALARS


def _refused_or_translated(translate) -> None:
    try:
        translate()
    except ValidationError:
        pass  # of the API's own request model: FastAPI's 400 naming the field
    except ValueError as exc:
        # A 400 whose param is the field the message starts with.
        field = str(exc).split(":", 1)[0]
        assert field and "\n" not in field and " " not in field.strip("'"), str(exc)


MESSAGES_BODY = st.fixed_dictionaries(
    {"model": st.just("m"), "max_tokens": SCALARS, "messages": JSON},
    optional={
        "system": JSON,
        "tools": JSON,
        "tool_choice": JSON,
        "stop_sequences": JSON,
        "metadata": JSON,
        "output_config": JSON,
        "thinking": JSON,
        "top_k": SCALARS,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MESSAGES_BODY)
def test_any_messages_body_is_translated_or_refused(body: dict[str, Any]):
    _refused_or_translated(lambda: messages.to_chat(MessagesRequest.model_validate(body)))


RESPONSES_BODY = st.fixed_dictionaries(
    {"model": st.just("m"), "input": JSON},
    optional={
        "instructions": JSON,
        "tools": JSON,
        "tool_choice": JSON,
        "text": JSON,
        "max_output_tokens": SCALARS,
        "parallel_tool_calls": SCALARS,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    RESPONSES_BODY,
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.just("assistant"),
                "content": st.none(),
                "tool_calls": st.just(
                    [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ]
                ),
            }
        ),
        max_size=1,
    ),
)
def test_any_responses_body_is_translated_or_refused(body: dict[str, Any], previous):
    def translate():
        request = ResponsesRequest.model_validate(body)
        responses.to_chat(request, responses.conversation(request, previous))

    _refused_or_translated(translate)
