"""The official `openai` Python client works against the router."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.helpers import LONG_CONTEXT, MODEL_NAME, engine, engine_info

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.router_url}/v1", api_key="unused", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_chat(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=16,
        temperature=0,
    )
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_repeated_prompt_reports_its_cached_blocks(client, stack):
    """A prompt seen for the first time has nothing cached; sent again, every
    full KV block before its last token is: the prefill engine's prefix cache
    hits (vLLM recomputes the block holding the last prompt token), which the
    decode engine reports in usage.prompt_tokens_details.cached_tokens."""
    block = engine_info(engine(stack, "prefill").grpc).block_size
    # Unique from the first user token on: no earlier request shares a block.
    prompt = f"Case {uuid.uuid4().hex}. {LONG_CONTEXT}"

    def usage():
        return client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=4,
            temperature=0,
        ).usage

    first, second = usage(), usage()
    tokens = first.prompt_tokens
    assert tokens == second.prompt_tokens and tokens > 2 * block
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == (tokens - 1) // block * block


def test_chat_stream(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage.completion_tokens > 0


def test_completions(client):
    reply = client.completions.create(
        model=MODEL_NAME, prompt="def fibonacci(n):", max_tokens=16, temperature=0
    )
    assert reply.choices[0].text
    stream = client.completions.create(
        model=MODEL_NAME, prompt="def fibonacci(n):", max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == reply.choices[0].text


def test_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=4)
