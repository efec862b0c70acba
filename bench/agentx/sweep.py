"""Sweeps: one trace replayed at several concurrencies against several named
endpoints in one run, interleaved (for each concurrency, every endpoint in
turn) so that the machine's drift touches all of them alike; ratios against a
named baseline endpoint at each concurrency.

Every run uses a fresh content salt: the same block structure with new tokens,
so no run starts with the previous run's prefixes already cached (endpoints
may share engines).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.workload.content import PromptBuilder
from tandem.workload.replay import ReplayConfig, Replayer, build_prompts, new_salt
from tandem.workload.runs import make_run, write_run
from tandem.workload.trace import Session


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str
    model: str | None = None


def parse_endpoint(spec: str) -> Endpoint:
    """``NAME=URL`` or ``NAME=URL#MODEL``."""
    if "=" not in spec:
        raise ValueError(f"--endpoint {spec!r}: expected NAME=URL (e.g. pd=http://127.0.0.1:8000)")
    name, rest = spec.split("=", 1)
    url, _, model = rest.partition("#")
    if not name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--endpoint {spec!r}: expected NAME=http://HOST:PORT")
    return Endpoint(name=name, url=url.rstrip("/"), model=model or None)


def run_sweep(
    sessions: list[Session],
    trace_info: dict,
    endpoints: list[Endpoint],
    concurrencies: list[int],
    base_cfg: ReplayConfig,
    tokenizer,
    out_dir: Path,
    resolve_model: Callable[[str], str],
    log: Callable[[str], None] = print,
) -> list[dict]:
    runs: list[dict] = []
    for c in concurrencies:
        for ep in endpoints:
            model = ep.model or resolve_model(ep.url)
            builder = PromptBuilder(tokenizer, salt=new_salt())
            prompts = build_prompts(sessions, builder)
            cfg = replace(base_cfg, url=ep.url, model=model, concurrency=c)
            log(f"sweep: {ep.name} ({ep.url}) concurrency {c}")
            result = asyncio.run(Replayer(cfg, sessions, prompts, salt=builder.salt).run())
            run = make_run(ep.name, result.to_json(), trace_info)
            write_run(run, out_dir / f"{ep.name}-c{c}" / "run.json")
            runs.append(run)
            s = run["summary"]
            log(
                f"  ok {s['ok']} fail {s['failures']} ttft p50 {s['ttft_p50']} "
                f"hit {s['hit_rate']} out tok/s {s['output_tokens_per_s']}"
            )
            if result.interrupted:
                log("sweep interrupted: writing what was measured")
                return runs
    return runs
