"""The text of Messages blocks and Responses parts (`translation.text_of`),
one helper for both APIs. Pure; no engines."""

from __future__ import annotations

import pytest

from services.router.api.responses.translate import TEXT_PARTS
from services.router.api.translation import text_of


def test_a_string_is_its_own_text():
    assert text_of("hi", "system") == "hi"


def test_text_blocks_are_joined():
    assert text_of([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "x") == "ab"


def test_responses_parts_of_each_text_kind_are_joined():
    parts = [{"type": kind, "text": kind[0]} for kind in TEXT_PARTS]
    assert text_of(parts, "input[0].content", unit="parts", kinds=TEXT_PARTS) == "iot"


@pytest.mark.parametrize(
    "content, message",
    [
        (7, "system: a string or a list of text blocks"),
        ([{"type": "text", "text": "a"}, {"type": "image"}], r"system\[1\]: only text blocks"),
        ([{"type": "text", "text": 3}], r"system\[0\]: only text blocks"),
        (["a"], r"system\[0\]: only text blocks"),
    ],
)
def test_anything_else_names_the_field(content, message):
    with pytest.raises(ValueError, match=message):
        text_of(content, "system")


def test_a_kind_of_another_api_is_refused():
    with pytest.raises(ValueError, match=r"content\[0\]: only text parts"):
        text_of([{"type": "input_text", "text": "a"}], "content", unit="parts")
