"""Conversion between the wire's SamplingParams and vLLM's."""

from __future__ import annotations

import json
from typing import Any

from common.proto import engine_pb2 as pb

_OPTIONAL_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


# The model's generation_config defaults that apply when a request leaves a
# field unset (what vLLM's own OpenAI server does).
DEFAULTABLE = (*_OPTIONAL_FLOATS, "top_k")


def to_vllm(
    params: pb.SamplingParams,
    *,
    defaults: dict[str, Any] | None = None,
    max_tokens: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    constrained: bool = True,
):
    """Build vLLM SamplingParams; raises ValueError on invalid values.

    `constrained=False` drops the structured-output constraint: a prefill
    engine's one sampled token is discarded, and compiling the constraint
    there would only delay the prefill."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    kwargs: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k in DEFAULTABLE}
    for name in _OPTIONAL_FLOATS:
        if params.HasField(name):
            kwargs[name] = getattr(params, name)
    if params.HasField("top_k"):
        kwargs["top_k"] = params.top_k
    if params.HasField("min_tokens"):
        kwargs["min_tokens"] = params.min_tokens
    if params.HasField("seed"):
        kwargs["seed"] = params.seed
    if params.HasField("logprobs"):
        kwargs["logprobs"] = params.logprobs
    if constrained and params.HasField("structured"):
        kwargs["structured_outputs"] = structured_to_vllm(params.structured)
    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else (params.max_tokens or None),
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra_args,
        **kwargs,
    )


def structured_to_vllm(structured: pb.StructuredOutput):
    from vllm.sampling_params import StructuredOutputsParams

    kind = structured.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured: no constraint given")
    value: Any = getattr(structured, kind)
    if kind == "choice":
        value = list(value.values)
    name = {"json_schema": "json"}.get(kind, kind)
    return StructuredOutputsParams(**{name: value}, disable_any_whitespace=structured.compact)


def parse_kv_transfer_params(raw: str) -> dict[str, Any] | None:
    if not raw:
        return None
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("kv_transfer_params_json must be a JSON object")
    return value
