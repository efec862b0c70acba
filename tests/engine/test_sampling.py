"""The wire's structured-output constraint becomes vLLM's
StructuredOutputsParams on a generating engine and is dropped on prefill."""

from __future__ import annotations

import pytest

from common.proto import engine_pb2 as pb
from services.engine.sampling import to_vllm


@pytest.mark.parametrize(
    "structured, field, value",
    [
        (
            pb.StructuredOutput(json_schema='{"type":"object"}', compact=True),
            "json",
            '{"type":"object"}',
        ),
        (pb.StructuredOutput(json_object=True), "json_object", True),
        (pb.StructuredOutput(regex="[a-z]+"), "regex", "[a-z]+"),
        (pb.StructuredOutput(choice=pb.Choices(values=["y", "n"])), "choice", ["y", "n"]),
        (pb.StructuredOutput(grammar='root ::= "a"'), "grammar", 'root ::= "a"'),
    ],
)
def test_structured_output_reaches_vllm(structured, field, value):
    params = pb.SamplingParams(max_tokens=4, structured=structured)
    out = to_vllm(params).structured_outputs
    assert getattr(out, field) == value
    assert out.disable_any_whitespace == structured.compact
    assert to_vllm(params, constrained=False).structured_outputs is None


def test_empty_constraint_is_refused():
    with pytest.raises(ValueError, match="no constraint"):
        to_vllm(pb.SamplingParams(max_tokens=4, structured=pb.StructuredOutput()))
