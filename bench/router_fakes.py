"""Fixed-latency fake backends for measuring a router's own overhead.

Two servers with the same timing, so that any router in front of either one
adds only its own cost:

* ``openai``: an OpenAI-compatible HTTP server (aiohttp) for the HTTP routers
  (vllm-router, sglang-router): ``POST /v1/chat/completions`` and
  ``/v1/completions`` (streaming SSE as vLLM sends it, or one JSON body),
  ``GET /v1/models``, ``/health`` and the sglang-style info endpoints routers
  probe (``/get_model_info``, ``/get_server_info``, ``/server_info``,
  ``/get_load``, ``/health_generate``, ``/metrics``). ``GET /_fake/paths``
  lists every path asked for and how often (what a router probes).
* ``grpc``: the ``tandem.engine.v1.Engine`` service plus ``grpc.health.v1``
  (SERVING) for the Tandem router, answering like services/engine/servicer.py:
  GetModelInfo (role ``both``, block size 128), GetLoad (its in-flight count),
  Generate (one token per message, usage on the last) and GenerateStream
  (the same requests multiplexed, common/engine_stream.py).

Every token is the text " tok" unless the gRPC fake is given ``--token-text``
(tests start several fakes with different texts to see which one served).

Timing, per request, on an absolute schedule from arrival (so a slow event loop
does not add up): token *i* (0-based) is sent at ``first_token_ms +
i * token_delay_ms``. The number of tokens is the request's ``max_tokens``
(``--tokens`` when absent). With ``--steps`` each token waits for the next
tick of a clock shared by all requests (every ``token_delay_ms``), so that
the tokens of all requests in flight go out together, as an engine's step
hands them out.

    python -m bench.router_fakes openai --port 8100 --first-token-ms 20 --token-delay-ms 5
    python -m bench.router_fakes grpc --port 8101 --model-path ~/.cache/tandem/models/...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from common.model import DEFAULT_MODEL_NAME
from common.settings import add_arguments, from_arguments
from common.tls import GrpcTlsSettings

MODEL_NAME = DEFAULT_MODEL_NAME
TOKEN_TEXT = " tok"
TOKEN_ID = 1234  # any id inside SmolLM2's vocabulary


@dataclass(frozen=True)
class Timing:
    first_token_ms: float = 20.0
    token_delay_ms: float = 5.0
    tokens: int = 16  # when the request has no max_tokens
    # Like an engine stepping: each token waits for the next step boundary (a
    # shared clock ticking every token_delay_ms), so the tokens of every
    # request in flight go out together, as vLLM hands out a step's outputs.
    steps: bool = False

    def due(self, arrival: float, offset_s: float) -> float:
        """When a token `offset_s` after `arrival` is sent."""
        t = arrival + offset_s
        if not self.steps or self.token_delay_ms <= 0:
            return t
        step = self.token_delay_ms / 1000.0
        return _STEP_EPOCH + math.ceil((t - _STEP_EPOCH) / step) * step

    def offsets_s(self, n: int) -> list[float]:
        """Seconds from arrival at which each of `n` tokens is due."""
        return [(self.first_token_ms + i * self.token_delay_ms) / 1000.0 for i in range(n)]

    def count(self, max_tokens) -> int:
        try:
            n = int(max_tokens) if max_tokens is not None else self.tokens
        except (TypeError, ValueError):
            n = self.tokens
        return max(1, n)


_STEP_EPOCH = time.perf_counter()


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


# -- OpenAI HTTP --------------------------------------------------------------


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def sse_chunks(
    request_id: str,
    kind: str,
    n: int,
    prompt_tokens: int,
    include_usage: bool,
    model: str = MODEL_NAME,
) -> list[bytes]:
    """The SSE events of one streamed response, in order, as vLLM sends them:
    an opening role chunk (chat only), one chunk per token (the last carries
    finish_reason "length"), the usage chunk when asked for, then [DONE].
    Element 0 is sent at once, element i (1..n) when token i-1 is due, the
    rest together with the last token."""
    created = int(time.time())
    chat = kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": request_id, "object": obj, "created": created, "model": model}

    def choice(text: str | None, finish: str | None) -> dict:
        if chat:
            delta = {"content": text} if text is not None else {}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def event(payload: dict) -> bytes:
        return b"data: " + _dumps(payload) + b"\n\n"

    out = []
    if chat:
        out.append(
            event(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
        )
    else:
        out.append(b"")  # nothing to send before the first token
    middle = event({**base, "choices": [choice(TOKEN_TEXT, None)]})
    out.extend([middle] * (n - 1))
    out.append(event({**base, "choices": [choice(TOKEN_TEXT, "length")]}))
    if include_usage:
        out.append(event({**base, "choices": [], "usage": _usage(prompt_tokens, n)}))
    out.append(b"data: [DONE]\n\n")
    return out


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _prompt_tokens(body: dict) -> int:
    """A rough prompt length (words), so usage is plausible; nothing depends on it."""
    if "messages" in body:
        text = " ".join(str(m.get("content", "")) for m in body.get("messages") or [])
    else:
        text = str(body.get("prompt", ""))
    return max(1, len(text.split()))


def create_openai_app(
    timing: Timing, model: str = MODEL_NAME, max_model_len: int = 8192, model_path: str = ""
):
    from aiohttp import web

    paths: Counter[str] = Counter()

    @web.middleware
    async def count_paths(request, handler):
        paths[f"{request.method} {request.path}"] += 1
        return await handler(request)

    async def generate(request: web.Request, kind: str):
        arrival = time.perf_counter()
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        n = timing.count(body.get("max_tokens") or body.get("max_completion_tokens"))
        prompt_tokens = _prompt_tokens(body)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        offsets = timing.offsets_s(n)
        if not body.get("stream"):
            await _sleep_until(timing.due(arrival, offsets[-1]))
            text = TOKEN_TEXT * n
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "length",
                }
                if kind == "chat"
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            )
            return web.json_response(
                {
                    "id": request_id,
                    "object": "chat.completion" if kind == "chat" else "text_completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [choice],
                    "usage": _usage(prompt_tokens, n),
                }
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = sse_chunks(request_id, kind, n, prompt_tokens, include_usage, model)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if chunks[0]:
            await response.write(chunks[0])
        for i, due in enumerate(offsets):
            await _sleep_until(timing.due(arrival, due))
            if i < n - 1:
                await response.write(chunks[1 + i])
            else:
                await response.write(b"".join(chunks[1 + i :]))
        await response.write_eof()
        return response

    async def chat(request):
        return await generate(request, "chat")

    async def completions(request):
        return await generate(request, "completion")

    model_card = {
        "id": model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "fake",
        "root": model,
        "max_model_len": max_model_len,
    }
    model_info = {
        "model_path": model_path or model,
        "tokenizer_path": model_path or model,
        "is_generation": True,
        "served_model_name": model,
        "max_total_num_tokens": max_model_len,
        "max_req_input_len": max_model_len,
    }
    server_info = {
        **model_info,
        "context_length": max_model_len,
        "max_model_len": max_model_len,
        "version": "fake",
        "disaggregation_mode": "null",
        "dp_size": 1,
        "tp_size": 1,
        "internal_states": [{"load": 0}],
    }

    async def ok(request):
        return web.json_response({"status": "ok"})

    async def models(request):
        return web.json_response({"object": "list", "data": [model_card]})

    async def get_model_info(request):
        return web.json_response(model_info)

    async def get_server_info(request):
        return web.json_response(server_info)

    async def get_load(request):
        return web.json_response(
            [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        )

    async def metrics(request):
        return web.Response(text="# fake backend: no metrics\n")

    async def seen_paths(request):
        return web.json_response(dict(paths))

    # Any prompt length: a 1M-token chat is about 4 MiB of JSON.
    app = web.Application(middlewares=[count_paths], client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    for path in ("/health", "/health_generate", "/ping", "/readiness", "/liveness"):
        app.router.add_get(path, ok)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/server_info", get_server_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/_fake/paths", seen_paths)
    return app


def serve_openai(host: str, port: int, timing: Timing, **kwargs) -> None:
    from aiohttp import web

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(
        create_openai_app(timing, **kwargs),
        host=host,
        port=port,
        print=None,
        access_log=None,
        handle_signals=True,
    )


# -- gRPC engine --------------------------------------------------------------


def create_grpc_servicer(
    timing: Timing,
    model: str = MODEL_NAME,
    model_path: str = "",
    max_model_len: int = 8192,
    block_size: int = 128,
    token_text: str = TOKEN_TEXT,
):
    import grpc

    from common.engine_stream import GenerateRpcs, RequestFailed
    from common.proto import engine_pb2 as pb
    from common.proto import engine_pb2_grpc as pb_grpc

    class FakeEngine(GenerateRpcs, pb_grpc.EngineServicer):
        def __init__(self) -> None:
            self.in_flight = 0

        async def _generate(self, request):
            arrival = time.perf_counter()
            if not request.token_ids:
                raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
            n = timing.count(request.sampling_params.max_tokens or None)
            self.in_flight += 1
            try:
                for i, due in enumerate(timing.offsets_s(n)):
                    await _sleep_until(timing.due(arrival, due))
                    message = pb.GenerateResponse(token_ids=[TOKEN_ID], text=token_text)
                    if i == n - 1:
                        message.finish_reason = "length"
                        message.usage.CopyFrom(
                            pb.Usage(
                                prompt_tokens=len(request.token_ids),
                                completion_tokens=n,
                                cached_tokens=0,
                            )
                        )
                    yield message
            finally:
                self.in_flight -= 1

        async def Prefill(self, request, context):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "fake engine of role both: no Prefill"
            )

        async def ReleaseKv(self, request, context):
            return pb.ReleaseKvResponse()

        async def GetLoad(self, request, context):
            return pb.GetLoadResponse(
                in_flight=self.in_flight,
                running=self.in_flight,
                waiting=0,
                kv_cache_usage=0.0,
                draining=False,
            )

        async def GetModelInfo(self, request, context):
            return pb.GetModelInfoResponse(
                served_model_name=model,
                model_path=model_path,
                max_model_len=max_model_len,
                block_size=block_size,
                role="both",
                vocab_size=49152,
            )

    return FakeEngine()


async def start_grpc_server(
    host: str, port: int, timing: Timing, tls: GrpcTlsSettings | None = None, **kwargs
):
    """Start the fake engine on this event loop; returns the grpc.aio server.
    With `tls`, it speaks mutual TLS only, as the engine host does."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from common.proto import engine_pb2_grpc as pb_grpc
    from common.tls import TlsFiles

    server = grpc.aio.server()
    pb_grpc.add_EngineServicer_to_server(create_grpc_servicer(timing, **kwargs), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, TlsFiles(tls).server_credentials())
        if tls is not None and tls.enabled
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise SystemExit(f"cannot listen on {address}")
    await server.start()
    for name in ("", "tandem.engine.v1.Engine"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.bound_port = bound
    return server


def serve_grpc(host: str, port: int, timing: Timing, **kwargs) -> None:
    async def main() -> None:
        server = await start_grpc_server(host, port, timing, **kwargs)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(grace=0.5)

    asyncio.run(main())


def command(kind: str, host: str, port: int | str, model_path: str, *flags: str) -> list[str]:
    """The command line that starts a fake backend of `kind` (``openai`` or
    ``grpc``) on host:port with the model's tokenizer, plus `flags`."""
    return [
        sys.executable,
        "-m",
        "bench.router_fakes",
        kind,
        "--host",
        host,
        "--port",
        str(port),
        "--model-path",
        model_path,
        *flags,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.router_fakes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=("openai", "grpc"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--first-token-ms", type=float, default=Timing.first_token_ms)
    parser.add_argument("--token-delay-ms", type=float, default=Timing.token_delay_ms)
    parser.add_argument(
        "--tokens",
        type=int,
        default=Timing.tokens,
        help="tokens per response when the request sets no max_tokens",
    )
    parser.add_argument(
        "--steps",
        action="store_true",
        help="send tokens on a shared step clock (every --token-delay-ms), all requests' "
        "tokens of a step together, as an engine does",
    )
    parser.add_argument("--model", default=MODEL_NAME, help="served model name")
    parser.add_argument(
        "--model-path", default="", help="model folder reported by GetModelInfo / get_model_info"
    )
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument(
        "--token-text",
        default=TOKEN_TEXT,
        help="grpc: the text of every generated token (e.g. the fake's name)",
    )
    add_arguments(parser, GrpcTlsSettings, "TANDEM_FAKE_ENGINE_")
    args = parser.parse_args(argv)
    timing = Timing(args.first_token_ms, args.token_delay_ms, args.tokens, args.steps)
    if args.kind == "openai":
        serve_openai(
            args.host,
            args.port,
            timing,
            model=args.model,
            max_model_len=args.max_model_len,
            model_path=args.model_path,
        )
    else:
        serve_grpc(
            args.host,
            args.port,
            timing,
            model=args.model,
            model_path=args.model_path,
            max_model_len=args.max_model_len,
            token_text=args.token_text,
            tls=from_arguments(GrpcTlsSettings, args),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
