"""The request path across engines: Prefill on a prefill pod, then Generate
on a decode pod with the prefill's KV hand-off parameters (or Generate alone
on an aggregated pod).

Failure rules, in one place:
* A pod that is unreachable before the first byte is marked unhealthy and the
  step is retried on another pod of the same role.
* No prefill pod can serve → the decode pod computes the prompt itself.
* No decode pod can serve after a prefill succeeded, or the client leaves
  between prefill and decode → the prefill's leased KV is released at once
  through a decode engine (ReleaseKv), not left until its lease expires.
* A client that leaves mid-request cancels the gRPC call; the engine aborts
  the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics
from services.router.pods import EnginePod, PodPool
from tandem.proto import engine_pb2 as pb

log = logging.getLogger("tandem.router")

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.CANCELLED}
_RELEASE_TIMEOUT_S = 5.0


@dataclass
class EngineRequest:
    request_id: str
    token_ids: list[int]
    sampling: pb.SamplingParams
    cache_salt: str | None
    arrival: float  # time.perf_counter() when the HTTP request arrived


def _to_openai_error(exc: grpc.aio.AioRpcError, pod: EnginePod) -> OpenAIError:
    code, detail = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return OpenAIError(400, detail)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OpenAIError(429, detail, headers={"Retry-After": "1"})
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return OpenAIError(504, f"{pod.role} pod {pod.address} timed out")
    if code in _RETRYABLE:
        return OpenAIError(503, f"{pod.role} pod {pod.address} is unavailable: {detail}")
    return OpenAIError(502, f"{pod.role} pod {pod.address} failed: {code.name}: {detail}")


class Orchestrator:
    def __init__(self, pool: PodPool, metrics: RouterMetrics) -> None:
        self._pool = pool
        self._metrics = metrics
        self._background: set[asyncio.Task] = set()

    def _first_call(self, req: EngineRequest) -> None:
        self._metrics.overhead.observe(time.perf_counter() - req.arrival)

    async def stream(self, req: EngineRequest) -> AsyncIterator[pb.GenerateResponse]:
        """Run a request; yields the decode's messages, the last one final."""
        if self._pool.of_role("decode"):
            # Decode first: without a decode pod, a prefill would only strand KV.
            if self._pool.pick("decode") is None:
                raise OpenAIError(503, "no healthy decode pod is available")
            kv_params = await self._prefill(req)
            async for message in self._generate(req, "decode", kv_params):
                yield message
        else:
            self._first_call(req)
            async for message in self._generate(req, "both", ""):
                yield message

    async def _prefill(self, req: EngineRequest) -> str:
        """KV hand-off parameters from a prefill pod, or "" for local prefill."""
        if not self._pool.of_role("prefill"):
            self._first_call(req)
            self._metrics.local_prefill.labels("no_prefill_pods").inc()
            return ""
        tried: set[str] = set()
        while (pod := self._pool.pick("prefill", exclude=tried)) is not None:
            tried.add(pod.address)
            if len(tried) == 1:
                self._first_call(req)
            else:
                self._metrics.retries.labels("prefill").inc()
            pod.acquire()
            try:
                reply = await pod.stub.Prefill(pb.PrefillRequest(
                    request_id=req.request_id, token_ids=req.token_ids,
                    sampling_params=req.sampling, cache_salt=req.cache_salt))
                return reply.kv_transfer_params_json
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise _to_openai_error(exc, pod) from None
                pod.mark_unhealthy(f"Prefill failed: {exc.code().name}")
            finally:
                pod.release()
        if not tried:
            self._first_call(req)
        log.warning("request %s: no prefill pod could serve; decode prefills locally",
                    req.request_id)
        self._metrics.local_prefill.labels("prefill_unavailable").inc()
        return ""

    async def _generate(self, req: EngineRequest, role: str,
                        kv_params: str) -> AsyncIterator[pb.GenerateResponse]:
        tried: set[str] = set()
        first_byte = False
        try:
            while True:
                pod = self._pool.pick(role, exclude=tried)
                if pod is None:
                    raise OpenAIError(503, f"no healthy {role} pod is available "
                                      f"({len(tried)} tried)" if tried else
                                      f"no healthy {role} pod is available")
                if tried:
                    self._metrics.retries.labels(role).inc()
                tried.add(pod.address)
                pod.acquire()
                call = pod.stub.Generate(pb.GenerateRequest(
                    request_id=req.request_id, token_ids=req.token_ids,
                    sampling_params=req.sampling, kv_transfer_params_json=kv_params,
                    cache_salt=req.cache_salt))
                try:
                    async for message in call:
                        if not first_byte:
                            first_byte = True
                            self._metrics.ttft.observe(time.perf_counter() - req.arrival)
                        yield message
                    return
                except grpc.aio.AioRpcError as exc:
                    if first_byte or exc.code() not in _RETRYABLE:
                        raise _to_openai_error(exc, pod) from None
                    pod.mark_unhealthy(f"Generate failed: {exc.code().name}")
                finally:
                    call.cancel()  # no-op when finished; aborts the request otherwise
                    pod.release()
        finally:
            if kv_params and not first_byte:
                # The KV the prefill holds for this request will never be pulled.
                self._release_kv_soon(req.request_id, kv_params, exclude=tried)

    def _release_kv_soon(self, request_id: str, kv_params: str, exclude: set[str]) -> None:
        """Free a prefill's leased KV in the background (works while cancelled)."""
        task = asyncio.get_running_loop().create_task(
            self._release_kv(request_id, kv_params, exclude))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_kv(self, request_id: str, kv_params: str, exclude: set[str]) -> None:
        # Prefer a pod that did not just fail; the one the request was on is
        # fine too if it is still up (a client disconnect, not a pod failure).
        pods = sorted(self._pool.of_role("decode"),
                      key=lambda p: (not p.available, p.address in exclude))
        for pod in pods:
            try:
                await pod.stub.ReleaseKv(pb.ReleaseKvRequest(
                    request_id=request_id, kv_transfer_params_json=kv_params),
                    timeout=_RELEASE_TIMEOUT_S)
                self._metrics.kv_released.inc()
                log.info("request %s: released prefill KV via %s", request_id, pod.address)
                return
            except grpc.aio.AioRpcError as exc:
                log.debug("ReleaseKv via %s failed: %s", pod.address, exc.code().name)
        log.warning("request %s: could not release prefill KV early; its lease will expire",
                    request_id)

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=_RELEASE_TIMEOUT_S)
