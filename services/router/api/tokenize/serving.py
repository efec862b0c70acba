"""Tokenize and detokenize with the router's own tokenizer and chat template."""

from __future__ import annotations

import asyncio

import jinja2

from services.router.api.chat.tools import check_history, check_tools
from services.router.api.engine_request import EngineRequests
from services.router.api.protocol import named_bad_request, unrenderable
from services.router.api.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from services.router.errors import bad_request
from services.router.tokenizer import ChatTokenizer


class TokenizeServing:
    def __init__(self, requests: EngineRequests, tokenizer: ChatTokenizer) -> None:
        self._requests = requests
        self._tokenizer = tokenizer

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's `/tokenize`: the ids the router would send for this prompt
        or conversation (chat: the same template and tools as a chat request)."""
        if body.model is not None:
            self._requests.check_model(body)
        if body.messages is not None:
            try:
                messages = body.template_messages()
                check_history(messages)
                tools = [t.definition for t in check_tools(body.tools or [])]
            except ValueError as exc:
                raise named_bad_request(exc) from None
            if tools and not self._tokenizer.renders_tools:
                raise bad_request("this model's chat template does not render tools", param="tools")
            try:
                text = await asyncio.to_thread(
                    self._tokenizer.render, messages, tools, body.add_generation_prompt
                )
            except jinja2.TemplateError as exc:
                raise unrenderable(exc) from None
            add_special = bool(body.add_special_tokens)
        else:
            assert body.prompt is not None
            text = body.prompt
            add_special = body.add_special_tokens is not False
        ids = await asyncio.to_thread(self._tokenizer.ids, text, add_special)
        result = {
            "count": len(ids),
            "max_model_len": self._requests.card.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if body.return_token_strs:
            result["token_strs"] = self._tokenizer.hf_tokenizer.convert_ids_to_tokens(ids)
        return result

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's `/detokenize`: the text of token ids."""
        if body.model is not None:
            self._requests.check_model(body)
        tokenizer = self._tokenizer.hf_tokenizer
        unknown = [t for t in body.tokens if t >= len(tokenizer)]
        if unknown:
            raise bad_request(
                f"tokens: {unknown[0]} is not a token id of this model (it has {len(tokenizer)})",
                param="tokens",
            )
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}
