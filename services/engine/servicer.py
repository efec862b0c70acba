"""The tandem.engine.v1.Engine gRPC service over an in-process vLLM AsyncLLM.

Prefill and decode are the same code: the KV connector configured for the
engine's role decides whether KV is produced for a remote decode or pulled
from a remote prefill. Every request ends in a final message or a gRPC error;
a cancelled call (client gone) aborts the request in vLLM, freeing its KV.
GenerateStream carries many Generate calls over one RPC, the router's
(common/engine_stream.py), with the same semantics per request. Once the
engine cannot serve any more (dead, or stalled inside a step), ``fail_all``
ends every request in flight with UNAVAILABLE at once, which the router
retries on another pod.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from common.engine_stream import GenerateRpcs, RequestFailed
from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc
from common.roles import Role
from services.engine.load import LoadTracker
from services.engine.metrics import EngineMetrics, request_phases
from services.engine.sampling import parse_kv_transfer_params, to_vllm
from services.kvstore.retention import from_proto as retention_from_proto
from services.kvstore.retention import with_hint

log = logging.getLogger(__name__)

# Parameters that make a prefill engine keep the KV for a remote decode.
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class EngineServicer(GenerateRpcs, pb_grpc.EngineServicer):
    def __init__(
        self,
        engine: Any,
        role: Role,
        model_path: str,
        served_model_name: str,
        load: LoadTracker,
        metrics: EngineMetrics,
    ) -> None:
        self._engine = engine
        self._role = role
        self._model_path = model_path
        self._served_model_name = served_model_name
        self._load = load
        self._metrics = metrics
        self._sampling_defaults = engine.model_config.get_diff_sampling_param()
        self._active: dict[str, asyncio.Task[Any]] = {}  # request id -> its RPC's task
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        self._failure: tuple[str, str] | None = None  # (metric reason, message for callers)

    # -- lifecycle ---------------------------------------------------------
    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def abort_all(self) -> None:
        if self._active:
            await self._engine.abort(list(self._active))

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def fail_all(self, reason: str, message: str) -> None:
        """The engine cannot finish anything any more: end every request in
        flight now, and every new one, with UNAVAILABLE (``message`` says
        why; ``reason`` labels the error metric), so callers retry elsewhere
        instead of waiting on this engine."""
        self._failure = (reason, message)
        self.draining = True
        for task in self._active.values():
            task.cancel()

    async def _run(
        self, request_id: str, prompt: dict, params, kind: str, remote_kv: bool = False
    ) -> AsyncIterator[Any]:
        """Run one request in vLLM, keeping the in-flight count, timing its
        phases (`remote_kv`: its KV comes from a prefill engine) and mapping
        errors to `RequestFailed`."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._failure is not None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, self._failure[1])
        if self.draining:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "engine is shutting down")
        if request_id in self._active:
            raise RequestFailed(
                grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} is already running"
            )
        task = asyncio.current_task()
        assert task is not None  # gRPC runs every call in a task, GenerateStream each request
        self._active[request_id] = task
        self._idle.clear()
        received = time.monotonic()
        self._load.request_started(received)
        self._metrics.requests.labels(kind).inc()
        first = True
        try:
            async for out in self._engine.generate(prompt, params, request_id):
                if first:
                    first = False
                    phases = request_phases(out.metrics, remote_kv, received)
                    self._metrics.observe_phases(phases)
                    log.debug(
                        "request %s (%s, %d prompt tokens, %s cached): %s",
                        request_id,
                        kind,
                        len(prompt["prompt_token_ids"]),
                        out.num_cached_tokens,
                        " ".join(f"{k} {v:.3f}s" for k, v in phases.items()),
                    )
                yield out
        except asyncio.CancelledError:
            # vLLM's generator already aborted the request.
            if self._failure is None:  # the caller went away
                self._metrics.cancelled.labels(kind).inc()
                raise
            # fail_all cancelled it: tell the caller, who is still waiting.
            task.uncancel()
            self._metrics.errors.labels(kind, self._failure[0]).inc()
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, self._failure[1]) from None
        except EngineDeadError as exc:
            self._metrics.errors.labels(kind, "engine_dead").inc()
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"engine dead: {exc}") from None
        except (ValueError, VLLMClientError) as exc:  # e.g. a grammar that does not compile
            self._metrics.errors.labels(kind, "invalid").inc()
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        finally:
            self._active.pop(request_id, None)
            self._load.request_ended()
            if not self._active:
                self._idle.set()

    @staticmethod
    def _prompt(token_ids, cache_salt: str | None) -> dict:
        prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        return prompt

    def _sampling(self, request, **kwargs):
        from vllm.exceptions import VLLMClientError

        try:
            return to_vllm(request.sampling_params, defaults=self._sampling_defaults, **kwargs)
        except (ValueError, TypeError, VLLMClientError) as exc:
            self._metrics.errors.labels("sampling", "invalid").inc()
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    @staticmethod
    def _retention(request):
        """The router's KV store retention hint, checked before vLLM sees it."""
        if not request.HasField("retention"):
            return None
        try:
            return retention_from_proto(request.retention)
        except ValueError as exc:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"retention: {exc}") from None

    async def _prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        if self._role == Role.DECODE:
            raise RequestFailed(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this engine is a decode engine; send Prefill to a prefill engine",
            )
        if not request.token_ids:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        hint = self._retention(request)
        params = self._sampling(
            request,
            max_tokens=1,
            constrained=False,
            kv_transfer_params=with_hint(dict(_REMOTE_DECODE), hint),
        )
        final = None
        async for out in self._run(
            request.request_id,
            self._prompt(request.token_ids, request.cache_salt or None),
            params,
            "prefill",
        ):
            final = out
        if final is None or final.kv_transfer_params is None:
            raise RequestFailed(
                grpc.StatusCode.INTERNAL,
                "prefill produced no kv_transfer_params "
                "(is a KV connector configured for role prefill?)",
            )
        return pb.PrefillResponse(
            kv_transfer_params_json=json.dumps(final.kv_transfer_params),
            prompt_tokens=len(final.prompt_token_ids or request.token_ids),
            cached_tokens=final.num_cached_tokens or 0,
        )

    async def _generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        if not request.token_ids:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        try:
            kv_params = parse_kv_transfer_params(request.kv_transfer_params_json)
        except ValueError as exc:
            raise RequestFailed(
                grpc.StatusCode.INVALID_ARGUMENT, f"kv_transfer_params: {exc}"
            ) from None
        if kv_params and self._role == Role.PREFILL:
            raise RequestFailed(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this engine is a prefill engine; it cannot pull remote KV",
            )
        hint = self._retention(request)
        params = self._sampling(request, kv_transfer_params=with_hint(kv_params, hint))
        completion_tokens = 0
        async for out in self._run(
            request.request_id,
            self._prompt(request.token_ids, request.cache_salt or None),
            params,
            "generate",
            remote_kv=bool(kv_params),
        ):
            choice = out.outputs[0]
            completion_tokens += len(choice.token_ids)
            message = pb.GenerateResponse(token_ids=list(choice.token_ids), text=choice.text)
            if choice.logprobs:
                message.logprobs.extend(_logprobs(choice.token_ids, choice.logprobs))
            if out.finished:
                message.finish_reason = choice.finish_reason or "stop"
                message.usage.CopyFrom(
                    pb.Usage(
                        prompt_tokens=len(out.prompt_token_ids or request.token_ids),
                        completion_tokens=completion_tokens,
                        cached_tokens=out.num_cached_tokens or 0,
                    )
                )
            yield message

    # -- RPCs --------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        try:
            return await self._prefill(request)
        except RequestFailed as exc:
            await context.abort(exc.code, exc.details)

    async def ReleaseKv(self, request: pb.ReleaseKvRequest, context) -> pb.ReleaseKvResponse:
        if self._role != Role.DECODE:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "ReleaseKv goes to a decode engine (the KV consumer)",
            )
        try:
            kv_params = parse_kv_transfer_params(request.kv_transfer_params_json)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kv_transfer_params: {exc}")
        if not kv_params:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "kv_transfer_params is empty")
        # A pre-aborted request runs the connector's cleanup, which tells the
        # prefill engine to free the blocks it keeps for this request.
        await self._engine.notify_kv_transfer_request_rejected(
            f"release-{request.request_id}", kv_params
        )
        self._metrics.kv_released.inc()
        return pb.ReleaseKvResponse()

    async def GetLoad(self, request, context) -> pb.GetLoadResponse:
        snap = self._load.latest
        blocks = self._engine.vllm_config.cache_config.num_gpu_blocks or 0
        return pb.GetLoadResponse(
            in_flight=self._load.in_flight,
            running=snap.running,
            waiting=snap.waiting,
            kv_cache_usage=snap.kv_cache_usage,
            draining=self.draining,
            kv_capacity_blocks=blocks,
        )

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        cfg = self._engine.vllm_config
        return pb.GetModelInfoResponse(
            served_model_name=self._served_model_name,
            model_path=self._model_path,
            max_model_len=cfg.model_config.max_model_len,
            block_size=cfg.cache_config.block_size or 0,
            role=self._role,
            vocab_size=cfg.model_config.get_vocab_size(),
        )


def _logprobs(token_ids, logprobs) -> list[pb.TokenLogprob]:
    result = []
    for token_id, candidates in zip(token_ids, logprobs):
        chosen = candidates.get(token_id)
        entry = pb.TokenLogprob(
            token_id=token_id,
            token=(chosen.decoded_token or "") if chosen else "",
            logprob=chosen.logprob if chosen else float("-inf"),
        )
        for cand_id, cand in sorted(candidates.items(), key=lambda kv: kv[1].rank or 0):
            if cand.rank is not None and cand.rank >= 1:
                entry.top.append(
                    pb.TopLogprob(
                        token_id=cand_id, token=cand.decoded_token or "", logprob=cand.logprob
                    )
                )
        result.append(entry)
    return result
