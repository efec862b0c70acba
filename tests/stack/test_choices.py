"""`n` > 1 through the router with the `openai` client, on the P/D stack:
one engine request per choice, whole and streamed, chat and completions."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import MODEL_NAME

pytestmark = pytest.mark.stack

ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.router_url}/v1", api_key="unused", max_retries=0)


def test_greedy_choices_are_the_single_answer(client):
    one = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=12, temperature=0
    )
    many = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=12, temperature=0, n=3
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert {c.message.content for c in many.choices} == {one.choices[0].message.content}
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_sampled_choices_differ_and_count(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=16,
        temperature=1.5,
        seed=7,
        n=4,
        logprobs=True,
        messages=[{"role": "user", "content": "Write one unusual word."}],
    )
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)


def test_streamed_choices_reassemble(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=12,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, usages = ["", ""], [None, None], []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=12, temperature=0
    )
    assert texts == [whole.choices[0].message.content] * 2
    assert finishes == [whole.choices[0].finish_reason] * 2
    (usage,) = usages
    assert usage.completion_tokens == 2 * whole.usage.completion_tokens


def test_forced_tool_calls_per_choice(client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "pick",
                "parameters": {
                    "type": "object",
                    "properties": {"colour": {"type": "string", "maxLength": 20}},
                    "required": ["colour"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=30,
        temperature=0,
        n=2,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "pick"}},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "pick"
    ids = {c.message.tool_calls[0].id for c in reply.choices}
    assert len(ids) == 2  # each choice's call has its own id


def test_completions_n(client):
    reply = client.completions.create(
        model=MODEL_NAME, prompt="The sky is", max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text == reply.choices[1].text
