"""The endpoint side of the replay client (tandem/workload/endpoint.py): the
SSE reader, the output deltas of a chunk, router replicas' URLs. Pure."""

from __future__ import annotations

import pytest

from tandem.workload.endpoint import is_done, output_deltas, sse_data, urls


def test_sse_data_reads_data_lines_of_text_and_bytes():
    assert sse_data('data: {"a":1}') == '{"a":1}'
    assert sse_data(b"data:[DONE]\n") == b"[DONE]"
    assert sse_data("") is None and sse_data(b"\n") is None
    assert sse_data(": keep-alive") is None and sse_data("event: x") is None
    assert is_done("[DONE]") and is_done(b"[DONE]") and not is_done("{}")


def test_output_deltas_count_choices_with_text():
    assert output_deltas({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == 0
    assert output_deltas({"choices": [{"delta": {"content": " a"}}]}) == 1
    assert (
        output_deltas(
            {"choices": [{"delta": {"reasoning_content": "hm"}}, {"delta": {"content": "b"}}]}
        )
        == 2
    )
    assert output_deltas({"choices": [], "usage": {"completion_tokens": 3}}) == 0


def test_urls_split_replicas():
    assert urls("http://a:1, http://b:2,") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="no URL"):
        urls(" , ")
