"""Tokenization, done once in the router exactly as vLLM's OpenAI server does
it: render the chat template to text, then encode without adding special
tokens (the template already has them). Engines receive token ids only.

A chat request that belongs to a session reuses the tokens of that session's
previous turn (`routing.IncrementalTokenizer`): same ids as encoding the whole
text, only the new suffix is tokenized."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from services.router.routing import IncrementalTokenizer


class ChatTokenizer:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_id = self._tok.eos_token_id
        # Incremental reuse needs offsets, which only fast tokenizers give.
        self._incremental = IncrementalTokenizer(self._tok) if self._tok.is_fast else None
        self._lock = threading.Lock()  # the session cache is shared by worker threads

    def chat(self, messages: list[dict[str, str]], session: str | None = None) -> list[int]:
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        if self._incremental is None or session is None:
            return self._tok(text, add_special_tokens=False)["input_ids"]
        with self._lock:
            return self._incremental.encode(text, session)

    def prompt(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=True)["input_ids"]

    # Long prompts take milliseconds to tokenize: keep the event loop free.
    async def chat_async(self, messages: list[dict[str, str]],
                         session: str | None = None) -> list[int]:
        return await asyncio.to_thread(self.chat, messages, session)

    async def prompt_async(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.prompt, text)
