"""Tokenization, done once in the router exactly as vLLM's OpenAI server does
it: render the chat template to text, then encode without adding special
tokens (the template already has them). Engines receive token ids only.

A chat request that belongs to a session reuses the tokens of that session's
previous turn (`routing.IncrementalTokenizer`): same ids as encoding the whole
text, only the new suffix is tokenized.

The template is rendered as `apply_chat_template(..., tokenize=False)` does
it — the same compiled Jinja template (transformers caches it), with the
tokenizer's special tokens as variables — minus that method's per-call work
(looking the template up, rebuilding the special-tokens map) and Jinja's
copy of the template's globals from a ChainMap, which cost more than the
render of a short chat (routing/README.md, "Measured")."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from transformers.utils.chat_template_utils import _compile_jinja_template

from services.router.routing import IncrementalTokenizer

# Texts up to this many characters are tokenized on the event loop: cheaper
# than a hop to a worker thread, whose hand-off and GIL contention cost more
# CPU than tokenizing a short prompt. Longer texts take milliseconds and go
# to a thread, keeping the loop free (figures: routing/README.md, "Measured").
INLINE_MAX_CHARS = 1024


class ChatTokenizer:
    def __init__(
        self,
        model_dir: Path,
        chat_template: str | None = None,
        cache_sessions: int = 10_000,
        cache_tokens: int = 20_000_000,
    ) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        if chat_template is not None:
            self._tok.chat_template = chat_template
        # Templates that ignore `tools` would drop them silently.
        self.renders_tools = "tools" in (self._tok.chat_template or "")
        # Incremental reuse needs offsets, which only fast tokenizers give;
        # their Rust backend also encodes without the Python wrapper's cost.
        self._incremental = (
            IncrementalTokenizer(self._tok, cache_sessions, cache_tokens)
            if self._tok.is_fast
            else None
        )
        self._encoder = self._incremental.encoder if self._incremental else None
        self._lock = threading.Lock()  # the session cache is shared by worker threads
        # Compiled templates by whether tools are given (a tokenizer may name
        # a "tool_use" template), and the variables every render gets.
        self._templates: dict[bool, Any] = {}
        self._template_vars = dict(self._tok.special_tokens_map)

    @property
    def session_cache(self) -> IncrementalTokenizer | None:
        """The per-session token cache (None: a slow tokenizer, no cache)."""
        return self._incremental

    @property
    def hf_tokenizer(self):
        return self._tok

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Chat messages as the prompt text the model sees."""
        return self._template(bool(tools)).render(
            messages=messages,
            tools=tools or None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._template_vars,
        )

    def _template(self, with_tools: bool) -> Any:
        template = self._templates.get(with_tools)
        if template is None:
            # Raises apply_chat_template's own error for a model without a template.
            source = self._tok.get_chat_template(None, [] if with_tools else None)
            # transformers' sandboxed environment (its filters, raise_exception)
            # compiles a template of our own: Jinja copies a template's globals
            # into every render's context, and kept in the ChainMap Jinja
            # builds, that copy costs more than rendering a short chat (10 of
            # 17 us); a plain dict of the same globals costs next to nothing.
            template = _compile_jinja_template(source).environment.from_string(source)
            template.globals = dict(template.globals)
            self._templates[with_tools] = template
        return template

    def ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._encoder is not None:
            return self._encoder.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def _encode(self, text: str, session: str | None, blocking: bool = True) -> list[int] | None:
        """Ids of rendered chat text; None when not `blocking` and another
        thread holds the session cache."""
        if self._incremental is None or session is None:
            return self.ids(text, add_special_tokens=False)
        if not self._lock.acquire(blocking=blocking):
            return None
        try:
            return self._incremental.encode(text, session)
        finally:
            self._lock.release()

    def chat(
        self,
        messages: list[dict],
        session: str | None = None,
        tools: list[dict] | None = None,
        stages: dict[str, float] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; ``stages`` (if given) gets the
        seconds spent in the template and in tokenization."""
        start = time.perf_counter()
        text = self.render(messages, tools)
        rendered = time.perf_counter()
        ids = self._encode(text, session)
        if stages is not None:
            stages["template"] = rendered - start
            stages["tokenize"] = time.perf_counter() - rendered
        return ids

    def prompt(self, text: str) -> list[int]:
        return self.ids(text, add_special_tokens=True)

    async def chat_async(
        self,
        messages: list[dict],
        session: str | None = None,
        tools: list[dict] | None = None,
        stages: dict[str, float] | None = None,
    ) -> list[int]:
        if not tools and sum(len(m["content"] or "") for m in messages) <= INLINE_MAX_CHARS:
            # Never wait on the loop for a worker thread's (long) encode.
            start = time.perf_counter()
            text = self.render(messages)
            rendered = time.perf_counter()
            ids = self._encode(text, session, blocking=False)
            if ids is not None:
                if stages is not None:
                    stages["template"] = rendered - start
                    stages["tokenize"] = time.perf_counter() - rendered
                return ids
        return await asyncio.to_thread(self.chat, messages, session, tools, stages)

    async def prompt_async(self, text: str, stages: dict[str, float] | None = None) -> list[int]:
        start = time.perf_counter()
        if len(text) <= INLINE_MAX_CHARS:
            ids = self.prompt(text)
        else:
            ids = await asyncio.to_thread(self.prompt, text)
        if stages is not None:
            stages["tokenize"] = time.perf_counter() - start
        return ids
