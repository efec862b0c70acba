"""`n` choices of one chat or completions request: one engine request each
(seeds apart, when given), merged into one response or one interleaved event
stream with its choices numbered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.proto import engine_pb2 as pb
from services.router.api.protocol import INT64_MAX, MAX_CHOICES, usage
from services.router.api.streaming import EventStream, Responder, Shape
from services.router.errors import OpenAIError
from services.router.pd import EngineRequest


async def respond_choices(
    responder: Responder,
    request: Request,
    ereq: EngineRequest,
    shapes: list[Shape],
    stream: bool,
    include_usage: bool,
) -> JSONResponse | StreamingResponse:
    """One choice per shape. The first runs until its first token — its
    prompt is then in the prefix cache — before the others start, so they
    reuse its KV."""
    if len(shapes) == 1:
        return await responder.respond(request, ereq, shapes[0], stream, include_usage)
    ereqs = [ereq, *(_another_choice(ereq, i) for i in range(1, len(shapes)))]
    streams = [responder.stream(e) for e in ereqs]
    try:
        first = await responder.until_done_or_gone(request, anext(streams[0]))
        others = await responder.until_done_or_gone(
            request, _all_or_none([anext(s) for s in streams[1:]])
        )
    except StopAsyncIteration:
        await asyncio.gather(*(s.aclose() for s in streams))
        raise OpenAIError(502, "the decode pod ended the stream without output") from None
    except BaseException:
        await asyncio.gather(*(s.aclose() for s in streams))
        raise
    firsts = [first, *others]
    if not stream:
        wholes = await responder.until_done_or_gone(
            request,
            _all_or_none(
                [
                    responder.collect_rest(e, shape, m, s)
                    for e, shape, m, s in zip(ereqs, shapes, firsts, streams, strict=True)
                ]
            ),
        )
        return JSONResponse(_merged_choices(wholes))
    return EventStream(
        sse_choices(responder, ereqs, shapes, firsts, streams, include_usage), shapes[0].closing
    )


async def sse_choices(
    responder: Responder,
    ereqs: list[EngineRequest],
    shapes: list[Shape],
    firsts: list[pb.GenerateResponse],
    streams: list[AsyncIterator[pb.GenerateResponse]],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The events of `n` choices, interleaved as their tokens come, each
    chunk's choice numbered; one usage chunk (all choices) at the end."""
    queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, rest: AsyncIterator[pb.GenerateResponse]) -> None:
        try:
            async for message in rest:
                await queue.put((index, message))
        except Exception as exc:  # noqa: BLE001 (handed to the stream, which reports it)
            await queue.put((index, exc))
        await queue.put((index, None))

    def events(index: int, message: pb.GenerateResponse) -> bytes:
        payloads = shapes[index].stream_payloads(ereqs[0].request_id, message, False)
        return b"".join(shapes[0].frame(_numbered(p, index)) for p in payloads)

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    finals: list[pb.GenerateResponse] = []
    try:
        async with asyncio.timeout(responder.timeout_s):
            chunk = b"".join(
                shapes[0].frame(_numbered(p, i))
                for i, shape in enumerate(shapes)
                for p in shape.opening_payloads(ereqs[0].request_id)
            )
            for i, message in enumerate(firsts):
                chunk += events(i, message)
                finals += [message] if message.finish_reason else []
            if chunk:
                yield chunk
            running = len(streams)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    finals += [item] if item.finish_reason else []
                    if chunk := events(index, item):
                        yield chunk
            if include_usage and finals:
                summed = _summed_usage([m.usage for m in finals])
                yield shapes[0].frame(shapes[0].usage_chunk(ereqs[0].request_id, summed))
    except OpenAIError as exc:
        yield shapes[0].error_event(exc)
    except TimeoutError:
        yield shapes[0].error_event(responder.timed_out())
    except (asyncio.CancelledError, GeneratorExit):
        responder.metrics.client_disconnects.inc()
        raise
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def _all_or_none(work: list) -> list:
    """The results of all `work`, or the first failure — the rest then
    cancelled (which aborts their engine requests), not left running."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _another_choice(ereq: EngineRequest, index: int) -> EngineRequest:
    """Choice `index` of a request: its own id, and its own seed when one is set
    (else the choices would be the same)."""
    sampling = pb.SamplingParams()
    sampling.CopyFrom(ereq.sampling)
    if sampling.HasField("seed"):
        # Stays within int64: counts down from the top.
        step = index if sampling.seed <= INT64_MAX - MAX_CHOICES else -index
        sampling.seed += step
    return replace(ereq, request_id=f"{ereq.request_id}-{index}", sampling=sampling)


def _numbered(payload: dict, index: int) -> dict:
    for choice in payload.get("choices", ()):
        choice["index"] = index
    return payload


def _summed_usage(usages: list[pb.Usage]) -> dict:
    """The usage of `n` choices: one prompt, every choice's completion; the
    cached prompt tokens of the first (the others reuse its KV)."""
    total = pb.Usage(
        prompt_tokens=usages[0].prompt_tokens,
        cached_tokens=usages[0].cached_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
    )
    return usage(total)


def _merged_choices(wholes: list[dict]) -> dict:
    """`n` whole responses as one with `n` choices."""
    merged = wholes[0]
    merged["choices"] = [_numbered(w, i)["choices"][0] for i, w in enumerate(wholes)]
    merged["usage"]["completion_tokens"] = sum(w["usage"]["completion_tokens"] for w in wholes)
    merged["usage"]["total_tokens"] = (
        merged["usage"]["prompt_tokens"] + merged["usage"]["completion_tokens"]
    )
    return merged
