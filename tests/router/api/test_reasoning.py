"""Reasoning split by vLLM's own parser (`olmo3`: `<think>` in plain text,
which SmolLM2's tokenizer spells with ordinary tokens) in the chat shape,
whole and streamed token by token, with the real tokenizer. No engines."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from common.model import resolve_model
from common.proto import engine_pb2 as pb
from services.router.api.chat.reasoning import ReasoningParsers
from services.router.api.chat.serving import ChatShape
from services.router.api.engine_request import ModelCard

CARD = ModelCard(name="m", max_model_len=1024, created=0)
OUTPUT = "<think>Two and two make four.</think>The answer is 4."


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(None))


@pytest.fixture(scope="module")
def parsers(tokenizer):
    return ReasoningParsers("olmo3", tokenizer)


def test_whole_output_is_split(parsers):
    reply = ChatShape(CARD, reasoning=parsers.start()).whole("id", OUTPUT, "stop", {}, [])
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "Two and two make four."
    assert message["content"] == "The answer is 4."


def test_streamed_output_is_split_the_same(parsers, tokenizer):
    shape = ChatShape(CARD, reasoning=parsers.start())
    ids = tokenizer(OUTPUT, add_special_tokens=False)["input_ids"]
    reasoning, content = "", ""
    for i, token in enumerate(ids):
        message = pb.GenerateResponse(
            token_ids=[token],
            text=tokenizer.decode([token]),
            finish_reason="stop" if i == len(ids) - 1 else "",
        )
        for chunk in shape.deltas("id", message):
            delta = chunk["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
    assert (reasoning, content) == ("Two and two make four.", "The answer is 4.")


def test_a_parser_the_tokenizer_cannot_serve_fails_at_start(tokenizer):
    with pytest.raises(RuntimeError, match="think"):
        ReasoningParsers("deepseek_r1", tokenizer)
