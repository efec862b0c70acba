"""P/D through the router versus one aggregated engine behind the same router.

One run, same machine, same requests: first the P/D stack (one prefill and
one decode engine), then the aggregated stack (one engine of role "both"),
each driven with N concurrent streaming chat requests. Prints TTFT p50/p90,
output tokens/s and the P/D ÷ aggregated ratios, plus the router's own
added latency (request in → first gRPC call out) read from its histogram.

    python -m bench.pd_vs_aggregated [--concurrency 8] [--requests 24]

On 2 CPU cores disaggregation is not expected to win: two engines share the
cores one engine would have. This is the baseline later work is judged by.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common.model import DEFAULT_MODEL_NAME
from common.ports import free_port
from services.stack import Stack, StackConfig
from tandem.workload.endpoint import is_done, output_deltas, sse_data
from tandem.workload.metrics import percentile

MODEL = DEFAULT_MODEL_NAME


def _prompt(i: int, words: int) -> str:
    # Distinct from the first token on, so no request reuses another's cache.
    body = " ".join(f"item{i}-{j}" for j in range(words))
    return f"Request {i}. Here is a log of events: {body}. Summarize it."


async def _one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            data = sse_data(line)
            if data is None or is_done(data):
                continue
            chunk = json.loads(data)
            if ttft is None and output_deltas(chunk):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {
        "ttft": ttft,
        "e2e": time.perf_counter() - start,
        "output_tokens": usage["completion_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
    }


async def drive(url: str, requests: int, concurrency: int, words: int, max_tokens: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        await _one(client, url, "warm up", 4)

        async def run(i: int) -> dict:
            async with limit:
                return await _one(client, url, _prompt(i, words), max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(requests)))
        wall = time.perf_counter() - start
    ttfts = [r["ttft"] for r in results]
    return {
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "output_tok_s": sum(r["output_tokens"] for r in results) / wall,
        "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in results),
        "wall_s": wall,
    }


def router_overhead(url: str) -> dict:
    """p50/p99 of tandem_router_overhead_seconds, interpolated in its buckets."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    buckets = []
    for line in text.splitlines():
        if line.startswith("tandem_router_overhead_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
    total = buckets[-1][1] if buckets else 0
    out = {"count": total}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        target, prev_le, prev_n = q * total, 0.0, 0.0
        for le, n in buckets:
            if n >= target:
                frac = 0 if n == prev_n else (target - prev_n) / (n - prev_n)
                out[name] = prev_le + (le - prev_le) * frac if le != float("inf") else prev_le
                break
            prev_le, prev_n = le, n
    return out


def run_stack(config: StackConfig, args) -> tuple[dict, dict]:
    stack = Stack(config)
    stack.start()
    try:
        figures = asyncio.run(
            drive(
                stack.router_url,
                args.requests,
                args.concurrency,
                args.prompt_words,
                args.max_tokens,
            )
        )
        return figures, router_overhead(stack.router_url)
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pd_vs_aggregated",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument(
        "--prompt-words", type=int, default=300, help="words per prompt (about 3 tokens each)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/pd_vs_aggregated.json"))
    args = parser.parse_args(argv)

    state = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    base = dict(kv_cache_gib=1, max_model_len=4096)
    pd, pd_overhead = run_stack(
        StackConfig(prefill=1, decode=1, router_port=free_port(), state_dir=state / "pd", **base),
        args,
    )
    agg, agg_overhead = run_stack(
        StackConfig(
            prefill=0,
            decode=0,
            aggregated=1,
            router_port=free_port(),
            state_dir=state / "agg",
            **base,
        ),
        args,
    )
    rows = [
        ("TTFT p50 (s)", "ttft_p50"),
        ("TTFT p90 (s)", "ttft_p90"),
        ("output tokens/s", "output_tok_s"),
    ]
    print(
        f"\n{args.requests} chat requests, concurrency {args.concurrency}, "
        f"~{pd['prompt_tokens_mean']:.0f} prompt tokens, {args.max_tokens} output tokens each"
    )
    print(f"{'metric':<18}{'P/D':>10}{'aggregated':>12}{'P/D ÷ agg':>12}")
    for label, key in rows:
        print(f"{label:<18}{pd[key]:>10.3f}{agg[key]:>12.3f}{pd[key] / agg[key]:>12.2f}")
    print(
        f"router overhead (request in → first gRPC call out), from its histogram: "
        f"P/D p50 {pd_overhead.get('p50', 0) * 1e3:.2f} ms p99 "
        f"{pd_overhead.get('p99', 0) * 1e3:.2f} ms; aggregated p50 "
        f"{agg_overhead.get('p50', 0) * 1e3:.2f} ms p99 "
        f"{agg_overhead.get('p99', 0) * 1e3:.2f} ms"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "pd": pd,
                "aggregated": agg,
                "pd_overhead": pd_overhead,
                "aggregated_overhead": agg_overhead,
                "args": {k: str(v) for k, v in vars(args).items()},
            },
            indent=2,
        )
    )
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
