"""Phase 1 of the rate-matching controller: profile one pool to saturation.

The agentic replay runs against a router URL at rising concurrency (1, 2, 4,
…) for a fixed time per level, a fresh content salt each level, until the
pool's throughput stops growing (or its TTFT p90 passes a ceiling). Each level
becomes one point of an ``EngineProfile`` (operators/planner/profiles.py):
request and token rates per replica, TTFT p50/p90, ITL, P90 interactivity,
prefix hit rate, and the mean requests inside the pool.

Where the URL is a Tandem router, the pool's own figures come from its
counters (``tandem_router_pool_*``, scraped before and after each level):
what that pool computed, its hit rate and its busy time. Elsewhere they come
from the client's records (busy time = the sum of TTFT for prefill, of E2E −
TTFT for decode, of E2E for an aggregated pool).

What is measured per role:

* ``prefill`` — requests capped at a few output tokens: the prefill pool is
  the bottleneck; throughput is its uncached prompt tokens per second.
* ``decode`` — give the trace long enough outputs (``--out-median``) that the
  decode pool is the bottleneck; throughput is output tokens per second.
* ``aggregated`` — the trace as it is; throughput is requests per second.

A P/D router lets the decode pod prefill a prompt itself when the part it
lacks is short (``--remote-prefill-threshold``, 256 tokens). Profiled that
way, the prefill pool sees only the least-cached prompts (on the agentic
trace 2 prompts in 21, hit rate 18% against the trace's 85%), never
saturates, and the decode pool's figures include prompt work: the profile
describes the routing, not the pool. So a prefill or decode profile needs the
router to send every prompt to the prefill pool
(``--remote-prefill-threshold 0``, ``PD_PROFILE_ROUTER_ARGS``), and a level
in which the decode pool computed prompts is refused (``foreign_prompts``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.model import cache_dir
from operators.planner.demand import Window
from operators.planner.profiles import (
    EngineConfig,
    EngineProfile,
    Parallelism,
    PoolRole,
    manifests_yaml,
    profile_configmap,
    profile_to_dict,
    validate,
)
from operators.planner.profiling import (
    MIN_GAIN,
    PREFILL_OUTPUT_TOKENS,
    Level,
    engine_config,
    foreign_prompts,
    point_from_level,
    pool_work,
)
from operators.planner.scrape import RouterScrapeSource
from tandem.workload.args import (
    add_replay_args,
    load_sessions,
    load_tokenizer,
    replay_config,
    run_command,
)
from tandem.workload.content import PromptBuilder
from tandem.workload.endpoint import served_model
from tandem.workload.replay import ReplayConfig, Replayer, build_prompts, new_salt
from tandem.workload.runs import make_run, write_run
from tandem.workload.trace import Session

# Kubernetes keeps at most this much of a container's termination message.
RESULT_BYTES = 4096


def log(msg: str) -> None:
    """A progress line on stderr (stdout stays free for what a command prints)."""
    print(msg, file=sys.stderr, flush=True)


async def measure_level(
    source: RouterScrapeSource,
    label: str,
    sessions: list[Session],
    trace_info: dict[str, Any],
    tokenizer: Any,
    cfg: ReplayConfig,
) -> tuple[dict[str, Any], Window | None]:
    """One replay (fresh content salt, so the cache starts cold) with the
    router's counters read just before and after it."""
    builder = PromptBuilder(tokenizer, salt=new_salt())
    prompts = build_prompts(sessions, builder)
    await source.window(time.monotonic())
    result = await Replayer(cfg, sessions, prompts, salt=builder.salt).run()
    w = await source.window(time.monotonic())
    if result.interrupted:
        raise KeyboardInterrupt
    return make_run(label, result.to_json(), trace_info), w


async def profile_pool(
    role: PoolRole,
    url: str,
    sessions: list[Session],
    trace_info: dict[str, Any],
    tokenizer: Any,
    base: ReplayConfig,
    config: EngineConfig,
    replicas: int,
    concurrencies: list[int],
    level_s: float,
    ttft_ceiling_s: float,
    workload: str,
    log: Callable[[str], None] = print,
) -> tuple[EngineProfile, list[Level]]:
    """Replay at each concurrency in turn until the pool's throughput grows
    by less than MIN_GAIN, its TTFT p90 passes ``ttft_ceiling_s``, or a level
    fails requests (that level is left out of the profile). A level of a
    prefill or decode pool in which the decode pool computed prompts raises
    RuntimeError (``foreign_prompts``)."""
    source = RouterScrapeSource([url])
    levels: list[Level] = []
    best = 0.0
    try:
        for c in concurrencies:
            cfg = replace(
                base,
                url=url,
                concurrency=c,
                duration_s=level_s,
                max_tokens_cap=PREFILL_OUTPUT_TOKENS if role == "prefill" else base.max_tokens_cap,
            )
            run, w = await measure_level(
                source, f"{role}-c{c}", sessions, trace_info, tokenizer, cfg
            )
            s = run["summary"]
            if s["failures"] or not s["ok"]:
                log(
                    f"profile {role}: {s['failures']} of {s['requests']} requests failed at "
                    f"c={c} ({s['failure_kinds']}); stopping, this level left out"
                )
                break
            if why := foreign_prompts(role, w):
                raise RuntimeError(f"profile {role} c={c}: {why}")
            point = point_from_level(role, replicas, c, run, w)
            levels.append(Level(c, run, w, point))
            work = pool_work(role, point)
            log(
                f"profile {role} c={c}: {point.request_rate:.3f} req/s per replica, "
                f"{work:.1f} work/s, TTFT p90 {point.ttft_p90_s or 0:.2f} s, "
                f"in flight {point.in_flight or 0:.2f}, hit {point.hit_rate:.1%}"
            )
            if work < best * (1 + MIN_GAIN):
                log(f"profile {role}: throughput stopped growing at c={c}")
                break
            best = max(best, work)
            if (point.ttft_p90_s or 0) > ttft_ceiling_s:
                log(f"profile {role}: TTFT p90 past {ttft_ceiling_s:g} s at c={c}; stopping")
                break
    finally:
        await source.aclose()
    if not levels:
        raise RuntimeError(f"profile {role}: no level measured")
    profile = EngineProfile(
        config=config,
        points=tuple(lv.point for lv in levels),
        source="measured",
        workload=workload,
        taken_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        replicas_measured=replicas,
        note=f"tandem profile --role {role}: {len(levels)} levels of {level_s:g} s against {url}",
    )
    return validate(profile), levels


# -- the command ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_replay_args(p, "~/.cache/tandem/profiles/<time>-<role>", lanes=False)
    p.add_argument(
        "--role",
        required=True,
        choices=["prefill", "decode", "aggregated"],
        help="the pool behind --url being profiled",
    )
    p.add_argument(
        "--concurrencies",
        default="1,2,4,8,16,32",
        help="rising concurrencies, until throughput stops growing (default 1,2,4,8,16,32)",
    )
    p.add_argument(
        "--level-s", type=float, default=60.0, help="seconds of replay per concurrency (default 60)"
    )
    p.add_argument(
        "--ttft-ceiling",
        type=float,
        default=60.0,
        help="stop once TTFT p90 passes this many seconds (default 60)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas in the profiled pool; rates are written per replica",
    )
    g = p.add_argument_group("the configuration profiled (written into the profile)")
    g.add_argument("--name", help="configuration name (default <model>-<role>)")
    g.add_argument("--hardware", default="", help="e.g. H100-80GB, cpu-core")
    g.add_argument(
        "--gpus-per-replica",
        type=int,
        default=1,
        help="GPUs of one replica (on CPU: the cores it is pinned to)",
    )
    for flag in ("tp", "pp", "dp", "pcp", "dcp"):
        g.add_argument(f"--{flag}", type=int, default=1, help=f"{flag.upper()} size")
    g.add_argument(
        "--scheduler-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="a vLLM scheduler flag the replicas run with (repeat)",
    )
    g.add_argument(
        "--kv-capacity-tokens",
        type=int,
        help="KV capacity of one replica, tokens (vLLM: num_gpu_blocks x block size)",
    )
    g.add_argument("--namespace", help="namespace of the ConfigMap written")
    p.add_argument("-o", "--output", help="profile ConfigMap to write (default <out>/profile.yaml)")
    p.add_argument(
        "--result-file",
        help="also write the profile document there as compact JSON of at most 4096 bytes "
        "(a pod's terminationMessagePath: how a TandemProfile's Job hands it to the "
        "operator); when the run fails, the error instead",
    )
    p.add_argument(
        "--wait-ready",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="first wait up to this long for GET --url/health to answer 200 (a router "
        "started beside the command)",
    )
    return p


def wait_ready(url: str, seconds: float) -> None:
    """Until the router's /health answers 200; RuntimeError after `seconds`."""
    import httpx

    deadline = time.monotonic() + seconds
    why = "no answer"
    while True:
        try:
            response = httpx.get(f"{url}/health", timeout=5)
            if response.status_code == 200:
                return
            why = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            why = str(exc) or type(exc).__name__
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health not ready after {seconds:g} s ({why})")
        time.sleep(1)


def result_json(profile: EngineProfile) -> str:
    """The profile document, compact, in at most RESULT_BYTES (ValueError if not)."""
    text = json.dumps(profile_to_dict(profile), separators=(",", ":"))
    if len(text.encode()) > RESULT_BYTES:
        raise ValueError(
            f"the profile ({len(profile.points)} points) takes {len(text.encode())} bytes, "
            f"over the {RESULT_BYTES} of a termination message: profile fewer levels"
        )
    return text


def runs_dir(a: argparse.Namespace) -> Path:
    """Where the levels' runs go: --out, else a new folder under the cache."""
    if a.out:
        return Path(a.out)
    return cache_dir() / "profiles" / f"{time.strftime('%Y%m%d-%H%M%S')}-{a.role}"


def cmd_profile(a: argparse.Namespace) -> int:
    try:
        concs = sorted({int(c) for c in a.concurrencies.split(",") if c.strip()})
    except ValueError:
        raise ValueError(f"--concurrencies {a.concurrencies!r}: expected e.g. 1,2,4") from None
    if not concs or concs[0] < 1 or a.replicas < 1 or a.level_s <= 0:
        raise ValueError("--concurrencies, --replicas and --level-s must be positive")
    if a.wait_ready > 0:
        wait_ready(a.url.rstrip("/"), a.wait_ready)
    sessions, info = load_sessions(a)
    tok, _ = load_tokenizer(a)
    model = a.model or served_model(a.url)
    name = a.name or f"{model}-{a.role}".lower()
    config = engine_config(
        a.role,
        name,
        model,
        a.gpus_per_replica,
        a.hardware,
        Parallelism(a.tp, a.pp, a.dp, a.pcp, a.dcp),
        a.scheduler_flag,
        a.kv_capacity_tokens,
    )
    st = info["stats"]
    workload = (
        f"{info['path']}: {st['sessions']} sessions, {st['requests']} requests, think "
        f"x{a.think_scale:g}"
    )
    out = runs_dir(a)
    log(
        f"profiling the {a.role} pool behind {a.url} ({a.replicas} replica(s)) at "
        f"concurrencies {concs}, {a.level_s:g} s each"
    )
    profile, levels = asyncio.run(
        profile_pool(
            a.role,
            a.url.rstrip("/"),
            sessions,
            info,
            tok,
            replay_config(a, a.url, model),
            config,
            a.replicas,
            concs,
            a.level_s,
            a.ttft_ceiling,
            workload,
            log=log,
        )
    )
    for level in levels:
        write_run(level.run, out / f"c{level.concurrency}" / "run.json")
    path = Path(a.output) if a.output else out / "profile.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        manifests_yaml(
            [profile_configmap(profile, name, a.namespace)], header=f"{profile.note}; {workload}"
        )
    )
    log(f"profile: {path} ({len(profile.points)} points; runs in {out})")
    if a.result_file:
        Path(a.result_file).write_text(result_json(profile))
    return 0


def cmd_profile_reporting(a: argparse.Namespace) -> int:
    """``cmd_profile``; with --result-file, a failure's reason is written
    there too (a pod's termination message says why its Job failed)."""
    try:
        return cmd_profile(a)
    except Exception as exc:
        if a.result_file:
            Path(a.result_file).write_text(f"tandem profile: error: {exc}"[:RESULT_BYTES])
        raise


def main(argv: list[str] | None = None) -> int:
    """``tandem profile``. Exit status: 0 success, 1 the run failed, 2 bad
    input, 130 interrupted."""
    a = build_parser().parse_args(argv)
    return run_command("tandem profile", lambda: cmd_profile_reporting(a))


if __name__ == "__main__":
    sys.exit(main())
