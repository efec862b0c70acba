"""Chat tokenization on the event loop (short texts) or in a worker thread
(long ones, or while a thread holds the session cache): the same ids as
tokenizing the whole text, with the real model tokenizer."""

from __future__ import annotations

import asyncio
import functools

import pytest

from common.model import resolve_model
from services.router.tokenizer import INLINE_MAX_CHARS, ChatTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer(resolve_model(None))


def _chat(chars: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": ("word " * chars)[:chars]},
    ]


@pytest.mark.parametrize("chars", [10, INLINE_MAX_CHARS - 20, INLINE_MAX_CHARS * 3])
async def test_chat_tokens_on_or_off_the_loop_equal_full_tokenization(tokenizer, chars):
    messages = _chat(chars)
    text = tokenizer.render(messages)
    full = tokenizer._tok(text, add_special_tokens=False)["input_ids"]
    assert await tokenizer.chat_async(messages) == full
    assert await tokenizer.chat_async(messages, session=f"s{chars}") == full
    assert await tokenizer.chat_async(messages, session=f"s{chars}") == full  # reused


async def test_busy_session_cache_sends_short_chats_to_a_thread(tokenizer):
    messages = _chat(50)
    full = tokenizer._tok(tokenizer.render(messages), add_special_tokens=False)["input_ids"]
    with tokenizer._lock:  # as if a worker thread were encoding a long chat
        pending = asyncio.ensure_future(tokenizer.chat_async(messages, session="busy"))
        await asyncio.sleep(0.05)
        assert not pending.done()  # waits in a thread, not on the loop
    assert await pending == full


@pytest.mark.parametrize("chars", [10, INLINE_MAX_CHARS * 3])
async def test_prompt_tokens_equal_the_tokenizer(tokenizer, chars):
    text = ("Once upon a time " * chars)[:chars]
    assert await tokenizer.prompt_async(text) == tokenizer._tok(text)["input_ids"]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Read a.py"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": {"path": "a.py"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
        {"role": "user", "content": "And now?"},
    ],
]


@functools.cache
def _tokenizer_with(template: str) -> ChatTokenizer:
    from services.router.chat_templates import CHATML_TOOLS

    tools_source = CHATML_TOOLS.read_text()
    tok = ChatTokenizer(resolve_model(None), tools_source if template == "chatml-tools" else None)
    if template == "named":
        tok.hf_tokenizer.chat_template = {
            "default": tok.hf_tokenizer.chat_template,
            "tool_use": tools_source.replace("<|im_start|>", "<|im_start|>[tools]"),
        }
    return tok


@pytest.mark.parametrize("template", ["model", "chatml-tools", "named"])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_render_equals_apply_chat_template(template, tools, generation_prompt, conversation):
    """The router renders the compiled template itself: the text is exactly
    what transformers' apply_chat_template makes (or the same error), for the
    model's template, the bundled tool template, and a tokenizer with named
    templates (the "tool_use" one is taken when tools are given)."""
    tok = _tokenizer_with(template)
    try:
        expected = tok.hf_tokenizer.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
    except Exception as exc:  # noqa: BLE001 (the same failure is expected)
        with pytest.raises(type(exc)):
            tok.render(conversation, tools, generation_prompt)
        return
    assert tok.render(conversation, tools, generation_prompt) == expected
