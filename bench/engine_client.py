"""A small synchronous client of the engine host, for the KV store benchmark and tests.

Prefill on a prefill engine, Generate on a decode (or aggregated) engine,
greedy sampling, and the engine's Prometheus figures that show where prompt
tokens came from (local compute, local prefix cache, external store/NIXL).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc


@dataclass
class Result:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float


class EngineClient:
    def __init__(self, grpc_port: int, metrics_port: int, host: str = "127.0.0.1") -> None:
        self.channel = grpc.insecure_channel(f"{host}:{grpc_port}")
        self.stub = pb_grpc.EngineStub(self.channel)
        self.metrics_url = f"http://{host}:{metrics_port}/metrics"

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout: float) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    @staticmethod
    def _sampling(max_tokens: int) -> pb.SamplingParams:
        return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def prefill(self, token_ids: list[int], timeout: float = 300) -> tuple[str, int, float]:
        start = time.perf_counter()
        resp = self.stub.Prefill(
            pb.PrefillRequest(
                request_id=f"p-{uuid.uuid4().hex[:12]}",
                token_ids=token_ids,
                sampling_params=self._sampling(1),
            ),
            timeout=timeout,
        )
        return resp.kv_transfer_params_json, resp.cached_tokens, time.perf_counter() - start

    def generate(
        self,
        token_ids: list[int],
        max_tokens: int = 8,
        kv_params: str = "",
        cache_salt: str | None = None,
        timeout: float = 300,
    ) -> Result:
        start = time.perf_counter()
        req = pb.GenerateRequest(
            request_id=f"g-{uuid.uuid4().hex[:12]}",
            token_ids=token_ids,
            sampling_params=self._sampling(max_tokens),
            kv_transfer_params_json=kv_params,
        )
        if cache_salt:
            req.cache_salt = cache_salt
        out: list[int] = []
        text = ""
        usage = None
        first = None
        for msg in self.stub.Generate(req, timeout=timeout):
            if first is None and msg.token_ids:
                first = time.perf_counter() - start
            out.extend(msg.token_ids)
            text += msg.text
            if msg.HasField("usage"):
                usage = msg.usage
        assert usage is not None, "Generate ended without usage"
        return Result(
            out,
            text,
            usage.prompt_tokens,
            usage.cached_tokens,
            first if first is not None else time.perf_counter() - start,
        )

    def metrics(self) -> dict[str, float]:
        """Sum of each sample over labels, plus label-qualified keys for sources."""
        text = httpx.get(self.metrics_url, timeout=5).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                values[s.name] = values.get(s.name, 0.0) + s.value
                for key in ("source", "operation", "status"):
                    if key in s.labels:
                        k = f"{s.name}{{{key}={s.labels[key]}}}"
                        values[k] = values.get(k, 0.0) + s.value
        return values


def long_prompt(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """A deterministic prompt of about ``n_tokens`` tokens, distinct per seed."""
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "tool",
        "result",
        "file",
        "line",
        "error",
        "value",
        "session",
        "agent",
        "return",
        "config",
        "table",
        "index",
    ]
    text = f"Session {seed}. " + " ".join(
        words[(i * 7 + seed * 13 + i // 5) % len(words)] for i in range(n_tokens)
    )
    ids = tokenizer(text)["input_ids"]
    return ids[:n_tokens]
