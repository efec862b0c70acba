"""The one engine request every API family's request becomes: the model it
names checked, its session found, its token budget checked against the
context, its sampling options on the wire."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from common.proto import engine_pb2 as pb
from services.router.api.protocol import SamplingFields
from services.router.errors import OpenAIError, bad_request
from services.router.pd import EngineRequest
from services.router.routing import session_key
from services.router.routing.sessions import SessionKey


@dataclass
class ModelCard:
    name: str
    max_model_len: int
    created: int


def sampling_params(body: SamplingFields, max_tokens: int) -> pb.SamplingParams:
    params = pb.SamplingParams(
        max_tokens=max_tokens,
        stop=body.stop or [],
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        skip_special_tokens=True,
    )
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_tokens",
        "seed",
    ):
        value = getattr(body, name)
        if value is not None:
            setattr(params, name, value)
    return params


class EngineRequests:
    """Builds engine requests for the model on `card`, reading the session
    from the headers the router was started with."""

    def __init__(
        self,
        card: ModelCard,
        session_header: str = "x-session-id",
        session_end_header: str = "x-session-end",
    ) -> None:
        self.card = card
        self._session_header = session_header
        self._session_end_header = session_end_header

    def check_model(self, body: Any) -> None:
        """A 404 unless `body.model` is the model this router serves."""
        if body.model != self.card.name:
            raise OpenAIError(
                404,
                f"The model '{body.model}' does not exist; this server serves '{self.card.name}'",
                param="model",
                code="model_not_found",
            )

    def session(self, request: Request, body: SamplingFields, **conversation) -> SessionKey | None:
        """Session key: the session header, else `user`, else derived from the
        conversation's opening (so clients that send neither still stick)."""
        return session_key(
            request.headers, {"user": body.user, **conversation}, header_name=self._session_header
        )

    def _session_ends(self, request: Request) -> bool:
        """The client marked this request as its session's last one."""
        value = request.headers.get(self._session_end_header, "")
        return value.strip().lower() in ("1", "true", "yes")

    def build(
        self,
        prefix: str,
        request: Request,
        body: SamplingFields,
        token_ids: list[int],
        prompt_param: str,
        session: SessionKey | None,
    ) -> EngineRequest:
        """The engine request for `token_ids`; a 400 naming `prompt_param`
        (or max_tokens) when it does not fit the model's context."""
        limit = self.card.max_model_len
        if len(token_ids) >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; "
                f"the prompt has {len(token_ids)} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        max_tokens = body.max_tokens or (limit - len(token_ids))
        if len(token_ids) + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; "
                f"you requested {len(token_ids) + max_tokens} "
                f"({len(token_ids)} in the prompt, {max_tokens} to generate)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return EngineRequest(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            token_ids=token_ids,
            sampling=sampling_params(body, max_tokens),
            cache_salt=body.cache_salt,
            arrival=request.state.arrival,
            session=session.key if session else None,
            session_source=session.source if session else None,
            session_end=self._session_ends(request),
        )
