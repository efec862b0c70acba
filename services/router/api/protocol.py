"""What the API families share on the wire: the integer limits of the engine
protocol, the sampling fields of chat and completions, OpenAI's usage object,
and the 400 that names the field at fault.

Only what Tandem serves is accepted; a field with an invalid value or an
unsupported option gets a 400 naming the field, never a silent ignore.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from common.proto import engine_pb2 as pb
from services.router.errors import OpenAIError, bad_request

# What the wire's integer fields carry (engine.proto): larger values are a
# 400 naming the field, not an overflow in the router.
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
MAX_CHOICES = 16


def _surrogate_at(value: Any, path: str) -> str | None:
    """The path of the first string in `value` that holds a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _surrogate_at(key, path) or _surrogate_at(item, f"{path}.{key}".lstrip("."))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _surrogate_at(item, f"{path}[{i}]")
            if found:
                return found
    return None


class RequestBody(BaseModel):
    """A request body of any family. JSON may spell a lone UTF-16 surrogate
    (``"\\ud800"``), which no UTF-8 string can hold: the tokenizer, gRPC and
    the session hash would all fail on it, so it is a 400 naming the field
    before anything else reads the body. (Parsed from JSON bytes by pydantic,
    as `json_body.JsonBodyRoute` does, a body cannot hold one: the parser
    rejects it and FastAPI's path, which lands here, says where.)"""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any, info: ValidationInfo) -> Any:
        if info.mode == "json":
            return data
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            param = _surrogate_at(data, "")
            raise bad_request(
                f"{param}: holds a lone UTF-16 surrogate, which is not valid Unicode",
                param=param,
            ) from None
        except (TypeError, ValueError):
            pass  # not JSON-shaped; the model's own validation says why
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(RequestBody):
    """Fields shared by chat and completions requests."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    # n > 1: one engine request per choice, the first prefilled before the
    # others start so that they reuse its KV from the prefix cache.
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, str):
            return [value]
        if value is not None and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
        return value

    # Options this server does not serve: a 400, never a silent ignore.
    unsupported: ClassVar[tuple[str, ...]] = ("echo", "best_of", "logit_bias", "suffix")

    @model_validator(mode="after")
    def _unsupported(self):
        extra = self.model_extra or {}
        for name in self.unsupported:
            value = extra.get(name)
            harmless = (
                value is None
                or value is False
                or value == []
                or value == {}
                or (name == "best_of" and value == 1)
            )
            if not harmless:
                raise ValueError(f"{name}: not supported by this server")
        return self


def usage(counts: pb.Usage) -> dict:
    """OpenAI's usage object of an engine's token counts."""
    return {
        "prompt_tokens": counts.prompt_tokens,
        "completion_tokens": counts.completion_tokens,
        "total_tokens": counts.prompt_tokens + counts.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": counts.cached_tokens},
    }


def named_bad_request(exc: ValueError) -> OpenAIError:
    """A 400 for a ValueError whose message starts with the field it names."""
    message = str(exc)
    return bad_request(message, param=message.split(":", 1)[0])


def unrenderable(exc: Exception) -> OpenAIError:
    """A 400 for messages the chat template fails on (a jinja2 error: the
    template reads a key these messages lack)."""
    return bad_request(
        f"messages: the chat template cannot render these messages ({exc})", param="messages"
    )
