"""Tokenization, done once in the router exactly as vLLM's OpenAI server does
it: render the chat template to text, then encode without adding special
tokens (the template already has them). Engines receive token ids only."""

from __future__ import annotations

import asyncio
from pathlib import Path


class ChatTokenizer:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_id = self._tok.eos_token_id

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def prompt(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=True)["input_ids"]

    # Long prompts take milliseconds to tokenize: keep the event loop free.
    async def chat_async(self, messages: list[dict[str, str]]) -> list[int]:
        return await asyncio.to_thread(self.chat, messages)

    async def prompt_async(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.prompt, text)
