"""Request validation of the router's APIs and the sampling options they
put on the wire, without any engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.router.api.chat.protocol import ChatCompletionRequest
from services.router.api.completions.protocol import CompletionRequest
from services.router.api.engine_request import sampling_params
from services.router.api.tokenize.protocol import TokenizeRequest


def chat(**fields):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_text_parts_are_joined_for_the_template():
    body = ChatCompletionRequest(
        model="m",
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
    )
    assert body.template_messages() == [{"role": "user", "content": "ab"}]


def test_non_text_parts_are_refused():
    body = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    )
    with pytest.raises(ValueError, match="only text"):
        body.template_messages()


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 2.5},
        {"top_p": 0},
        {"max_tokens": 0},
        {"n": 17},
        {"n": 0},
        {"stop": [str(i) for i in range(17)]},
        {"top_logprobs": 2},
        {"best_of": 2},
        {"presence_penalty": 3},
        {"logprobs": True, "top_logprobs": 21},
        # Beyond what the wire's integers carry.
        {"seed": 1208925819614629174706176},
        {"seed": -(2**63) - 1},
        {"top_k": 2**31},
        {"max_tokens": 2**32},
        {"min_tokens": 2**32},
        {"stop_token_ids": [2**32]},
    ],
)
def test_invalid_or_unsupported_fields_are_refused(fields):
    with pytest.raises(ValidationError):
        chat(**fields)


@pytest.mark.parametrize(
    "body", [{}, {"prompt": "a", "messages": []}, {"messages": []}, {"prompt": "a", "tools": [{}]}]
)
def test_tokenize_needs_a_prompt_or_some_messages(body):
    with pytest.raises(ValidationError):
        TokenizeRequest(**body)


def test_harmless_defaults_of_unsupported_fields_pass():
    chat(logprobs=False, tools=[], best_of=1)


def test_wire_integer_limits_pass():
    chat(seed=2**63 - 1, top_k=2**31 - 1, stop_token_ids=[2**32 - 1])
    chat(seed=-(2**63))


def test_max_completion_tokens_is_an_alias():
    assert chat(max_completion_tokens=7).max_tokens == 7


def test_sampling_params_carry_only_what_was_set():
    params = sampling_params(chat(temperature=0, stop="END", seed=3), max_tokens=10)
    assert params.max_tokens == 10 and list(params.stop) == ["END"] and params.seed == 3
    assert params.HasField("temperature") and params.temperature == 0
    assert not params.HasField("top_p")  # engine applies the model's default


@pytest.mark.parametrize(
    "prompt, ok",
    [
        ("text", True),
        ([1, 2, 3], True),
        (["one"], True),
        ([[1, 2]], True),
        ("", False),
        ([], False),
        (["a", "b"], False),
        ([1, -3], False),
        ([[2**32]], False),
    ],
)
def test_completion_prompt_shapes(prompt, ok):
    if ok:
        CompletionRequest(model="m", prompt=prompt)
    else:
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt=prompt)
