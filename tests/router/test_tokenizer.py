"""Chat tokenization on the event loop (short texts) or in a worker thread
(long ones, or while a thread holds the session cache): the same ids as
tokenizing the whole text, with the real model tokenizer."""

from __future__ import annotations

import asyncio

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
