"""Routing policies side by side: prefix hit rate, TTFT and throughput of the
same agentic replay through Tandem's router (its default policy, round-robin,
least-load) and through vllm-router's and sglang-router's best policies, in
front of the same engines, with ample KV cache and with KV smaller than the
sessions' working set.

    python -m bench.router_policies [--regimes ample,tight] [--contenders ...] [--repeat N]

"Same engines": two vLLM CPU engines with the same vLLM flags (model, dtype,
context, KV blocks, KV events, one core each). Tandem's router talks gRPC to
Tandem's engine hosts; the Rust routers need OpenAI HTTP servers, so they get
vLLM's own server (`vllm.entrypoints.openai.api_server`) with the same flags.
Per regime the gRPC pair runs first (every Tandem policy), then the HTTP pair
(every other router); this machine holds two engines at a time. Every run is
the same trace with a fresh content salt, so no run inherits another's cache
(in the tight regime the previous run's blocks are evicted as the next one
fills the cache, for every contender alike). Rows read as ratios against
Tandem's default policy in the same regime. With KV smaller than the working
set, which sessions share a pod decides much of the hit rate, and that changes
with the salt for hash-based policies: one run per contender is noisy (the same
hash-sticky policy measured 58% and 76%); ``--repeat`` runs every contender N
times, round by round, and the table gives means and the hit-rate range.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from bench.agentx import report
from bench.agentx.sweep import Endpoint, run_sweep
from bench.harness import RESULTS, RedisServer, log, sigterm_as_interrupt
from bench.routers import HOST, ROUTERS, find_binary, http_router_argv
from common.procs import Processes
from tandem.workload import generate, metrics
from tandem.workload.endpoint import served_model
from tandem.workload.replay import ReplayConfig

BASELINE = "tandem:cost"
# The engines' context and KV cache in these runs (bench.cpu_profile profiles
# engines set up the same way).
MAX_MODEL_LEN = 3072  # the small profile compacts past it
KV_CACHE_GIB = 1


@dataclass(frozen=True)
class Contender:
    router: str  # "tandem", "vllm-router" or "sglang-router"
    policy: str
    # vllm-router's kv_aware subscribes to the engines' KV events (Tandem's
    # router always does: that is its configuration in `tandem up`).
    kv_events: bool = False
    # Tandem router flags of a variant, e.g. ("--move-cost-factor", "1.0"):
    # `tandem:cost+move-cost-factor=1.0` on the command line.
    flags: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        variant = "".join(
            f"+{self.flags[i][2:]}={self.flags[i + 1]}" for i in range(0, len(self.flags), 2)
        )
        return f"{self.router}:{self.policy}{variant}"


def parse_variant(name: str, known: dict[str, Contender]) -> Contender | None:
    """``tandem:POLICY+FLAG=VALUE+...``: a Tandem policy with router flags, so
    a setting can be compared with the default on the same engines in one run."""
    base, *settings = name.split("+")
    c = known.get(base)
    if c is None or c.router != "tandem" or not settings:
        return None
    flags: list[str] = []
    for setting in settings:
        flag, sep, value = setting.partition("=")
        if not sep or not flag or not value:
            return None
        flags += [f"--{flag}", value]
    return replace(c, flags=tuple(flags))


CONTENDERS = (
    Contender("tandem", "cost"),
    Contender("tandem", "round-robin"),
    Contender("tandem", "least-load"),
    # round_robin on both frontends: the control that separates the policy from
    # the engine front end (Tandem's gRPC host vs vLLM's HTTP server).
    Contender("vllm-router", "round_robin"),
    Contender("vllm-router", "consistent_hash"),
    Contender("vllm-router", "sticky_least_loaded"),
    Contender("vllm-router", "cache_aware"),
    Contender("vllm-router", "kv_aware", kv_events=True),
    Contender("sglang-router", "cache_aware"),
)
# Also selectable with --contenders (Tandem's other policies, one flag apart).
EXTRA_CONTENDERS = (Contender("tandem", "session"), Contender("tandem", "prefix"))


@dataclass(frozen=True)
class Regime:
    name: str
    kv_blocks: int | None  # --num-gpu-blocks-override per engine; None = ample


@dataclass
class HttpEngine:
    url: str
    kv_events: str  # PUB,REPLAY endpoints
    proc: object


def contender_argv(
    c: Contender, port: int, engines: list[HttpEngine], model_dir: str, block_size: int
) -> list[str]:
    """vllm-router / sglang-router in front of the HTTP engines. kv_aware gets
    the engines' KV events and session affinity (its best configuration)."""
    argv = http_router_argv(ROUTERS[c.router], port, [e.url for e in engines], c.policy)
    if c.kv_events:
        for e in engines:
            pub, replay = e.kv_events.split(",")
            argv += [
                "--kv-event-source",
                f"{e.url}={pub}",
                "--kv-event-replay-source",
                f"{e.url}={replay}",
            ]
        argv += [
            "--kv-event-block-size",
            str(block_size),
            "--kv-event-model",
            model_dir,
            "--kv-aware-session-affinity-ttl-secs",
            "600",
        ]
    return argv


class PolicyBench:
    def __init__(self, a: argparse.Namespace, out: Path) -> None:
        from transformers import AutoTokenizer

        from common.model import resolve_model

        self.a = a
        self.out = out
        self.model_dir = str(resolve_model(None))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.sessions, self.info = generate.generated_trace(
            "small", sessions=a.sessions, turns_median=a.turns_median, seed=a.seed
        )
        self.base = ReplayConfig(
            url="",
            model="",
            think_scale=a.think_scale,
            timeout_s=a.timeout,
            progress=sys.stderr.isatty(),
        )
        self.problems: list[str] = []
        self.runs: list[dict] = []  # every finished run, kept if interrupted

    def stack_config(self, regime: Regime, state: Path):
        from services.stack import StackConfig

        blocks = (
            [] if regime.kv_blocks is None else ["--num-gpu-blocks-override", str(regime.kv_blocks)]
        )
        # No KV store unless asked: this compares routers, so a miss is a
        # recompute for all (the Rust routers' vLLM servers have no store).
        return StackConfig(
            prefill=0,
            decode=0,
            aggregated=self.a.engines,
            kv_store=self.a.kv_store,
            router=False,
            kv_cache_gib=KV_CACHE_GIB,
            max_model_len=self.a.max_model_len,
            state_dir=state,
            engine_args=[*blocks, *self.a.engine_arg],
        )

    def replay(self, name: str, url: str, regime: Regime, rep: int) -> dict | None:
        try:
            # The model by name: sglang-router's /v1/models says "unknown".
            endpoint = Endpoint(name, url, model=Path(self.model_dir).name)
            runs = run_sweep(
                self.sessions,
                self.info,
                [endpoint],
                [self.a.concurrency],
                replace(self.base),
                self.tokenizer,
                run_dir(self.out, regime.name, rep, self.a.repeat),
                served_model,
                log=log,
            )
        except Exception as e:  # report what was measured, say what was not
            self._failed(f"{regime.name} {name} (run {rep + 1})", e)
            return None
        run = runs[0]
        run["regime"] = regime.name
        run["rep"] = rep
        return run

    def each_router(self, contenders: list[Contender]):
        """(repetition, contender) pairs: every contender once per round, so a
        drift in the machine's state spreads over all of them."""
        return [(rep, c) for rep in range(self.a.repeat) for c in contenders]

    def run_router(
        self,
        procs: Processes,
        c: Contender,
        argv_for: Callable[[int], list[str]],
        regime: Regime,
        rep: int,
    ) -> None:
        """Start the router (``--replicas`` processes of it, each from
        ``argv_for(port)``), replay the trace through it, stop it."""
        from common.ports import free_port
        from common.procs import wait_http_ok

        name = c.name.replace(":", "-") + (f"-run{rep + 1}" if self.a.repeat > 1 else "")
        started = []
        try:
            for i in range(self.a.replicas):
                port = free_port()
                replica = name if self.a.replicas == 1 else f"{name}-replica{i}"
                proc, _ = procs.launch(
                    replica,
                    argv_for(port),  # its log: <replica>.log
                    set(os.sched_getaffinity(0)),
                )
                started.append((proc, port))
            for proc, port in started:
                wait_http_ok(
                    f"http://{HOST}:{port}{ROUTERS[c.router].ready_path}",
                    proc,
                    time.monotonic() + 120,
                )
            urls = ",".join(f"http://{HOST}:{port}" for _, port in started)
            run = self.replay(c.name, urls, regime, rep)
            if run:
                self.runs.append(run)
                if run["summary"].get("interrupted"):
                    raise KeyboardInterrupt  # Ctrl-C / SIGTERM: stop, keep what ran
        finally:
            for proc, _ in started:
                procs.stop(proc)

    def _failed(self, what: str, e: BaseException) -> None:
        self.problems.append(f"**{what}: not measured** — {type(e).__name__}: {e}")
        log(f"{what}: {type(e).__name__}: {e}")

    # -- Tandem: its engine hosts over gRPC, one router process per policy ----
    def tandem_runs(self, regime: Regime, contenders: list[Contender]) -> None:
        from services.stack import Stack

        state = Path(tempfile.mkdtemp(prefix=f"tandem-policies-{regime.name}-"))
        stack = Stack(self.stack_config(regime, state))
        procs = Processes(state)
        # Replicas share session bindings and in-flight load through Redis.
        redis_server = RedisServer(state) if self.a.replicas > 1 else None
        t0 = time.time()
        try:
            stack.start()
            log(f"{regime.name}: Tandem engines up in {time.time() - t0:.0f}s")
            if redis_server is not None:
                redis_server.start()
            for rep, c in self.each_router(contenders):
                shared = []
                if redis_server is not None:
                    import redis

                    # no run inherits bindings
                    redis.Redis.from_url(redis_server.url).flushall()
                    shared = ["--redis-url", redis_server.url]

                def argv_for(port: int, c: Contender = c, shared: list[str] = shared):
                    return stack.router_argv(port, ["--policy", c.policy, *c.flags, *shared])

                self.run_router(procs, c, argv_for, regime, rep)
        except Exception as e:
            self._failed(f"{regime.name} Tandem engines", e)
        finally:
            procs.stop_all()
            if redis_server is not None:
                redis_server.stop()
            stack.stop()

    # -- Rust routers: vLLM's own HTTP server, same engine flags --------------
    def http_runs(self, regime: Regime, contenders: list[Contender]) -> None:
        from common.ports import free_port
        from common.procs import wait_http_ok
        from services.stack import engine_cores, engine_env, kv_events_flags, vllm_flags

        state = Path(tempfile.mkdtemp(prefix=f"vllm-policies-{regime.name}-"))
        cfg = self.stack_config(regime, state)
        procs = Processes(state)
        try:
            engines = []
            t0 = time.time()
            for i, core in enumerate(engine_cores(self.a.engines)):
                port = free_port()
                events, endpoints = kv_events_flags(HOST, free_port(), free_port())
                argv = [
                    sys.executable,
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    *vllm_flags(cfg, model=self.model_dir),
                    "--served-model-name",
                    Path(self.model_dir).name,
                    *cfg.engine_args,
                    *events,
                    "--host",
                    HOST,
                    "--port",
                    str(port),
                    "--enable-prompt-tokens-details",
                ]
                proc, _ = procs.launch(
                    f"vllm-{i}",
                    argv,
                    set(os.sched_getaffinity(0)),
                    env=engine_env(cfg.kv_cache_gib, core),
                )
                engines.append(HttpEngine(f"http://{HOST}:{port}", endpoints, proc))
            for e in engines:
                wait_http_ok(f"{e.url}/health", e.proc, time.monotonic() + cfg.startup_timeout_s)
            log(f"{regime.name}: vLLM HTTP engines up in {time.time() - t0:.0f}s")
            for rep, c in self.each_router(contenders):

                def argv_for(port: int, c: Contender = c) -> list[str]:
                    return contender_argv(c, port, engines, self.model_dir, self.a.block_size)

                self.run_router(procs, c, argv_for, regime, rep)
        except Exception as e:
            self._failed(f"{regime.name} vLLM HTTP engines", e)
        finally:
            procs.stop_all()


def run_dir(out: Path, regime: str, rep: int, repeats: int) -> Path:
    return out / regime if repeats == 1 else out / regime / f"run{rep + 1}"


def summary_table(runs: list[dict], bound: float | None) -> str:
    """One row per regime and contender; ratios against Tandem's default in
    the same regime (TTFT: lower is better; hit rate and tok/s: higher).
    Repeated runs: the mean of the runs, and the hit rate's range."""
    head = (
        "| regime | router:policy | runs | hit rate | hit range | main-agent hit "
        "| sub-agent hit | TTFT p50 s | TTFT p90 s | output tok/s | total tok/s | fail "
        "| TTFT p50 ÷ tandem | TTFT p90 ÷ tandem |"
    )
    lines = [head, "|" + "---|" * 14]
    for regime in dict.fromkeys(r["regime"] for r in runs):
        rows = aggregate([r for r in runs if r["regime"] == regime])
        base = rows.get(BASELINE)
        for label, (n, s) in rows.items():
            lines.append(
                f"| {regime} | {label} | {n} | {_pct(s['hit_rate'])} "
                f"| {_pct(s['hit_min'])}–{_pct(s['hit_max'])} | {_pct(s['hit_main'])} "
                f"| {_pct(s['hit_sub'])} | {_f(s['ttft_p50'])} "
                f"| {_f(s['ttft_p90'])} | {_f(s['output_tokens_per_s'], 1)} "
                f"| {_f(s['total_tokens_per_s'], 0)} | {s['failures']} "
                f"| {_ratio(s, base and base[1], 'ttft_p50')} "
                f"| {_ratio(s, base and base[1], 'ttft_p90')} |"
            )
    if bound is not None:
        lines.append(
            f"\nHit-rate bound of the trace (unbounded cache, 128-token blocks): {_pct(bound)}."
        )
    return "\n".join(lines)


def aggregate(runs: list[dict]) -> dict[str, tuple[int, dict]]:
    """label -> (runs, mean summary + hit range), labels in first-seen order."""
    by_label: dict[str, list[dict]] = {}
    for r in runs:
        records = r.get("records") or []
        by_label.setdefault(r["label"], []).append(
            {
                **r["summary"],
                "hit_main": metrics.hit_rate([x for x in records if not x["agent"]]),
                "hit_sub": metrics.hit_rate([x for x in records if x["agent"]]),
            }
        )
    out = {}
    for label, sums in by_label.items():

        def mean(key: str, sums: list[dict] = sums):
            values = [s[key] for s in sums if s.get(key) is not None]
            return sum(values) / len(values) if values else None

        hits = [s["hit_rate"] for s in sums if s.get("hit_rate") is not None]
        out[label] = (
            len(sums),
            {
                **{
                    k: mean(k)
                    for k in (
                        "hit_rate",
                        "hit_main",
                        "hit_sub",
                        "ttft_p50",
                        "ttft_p90",
                        "output_tokens_per_s",
                        "total_tokens_per_s",
                    )
                },
                "hit_min": min(hits, default=None),
                "hit_max": max(hits, default=None),
                "failures": sum(s.get("failures") or 0 for s in sums),
            },
        )
    return out


def _f(v, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _pct(v) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _ratio(s: dict, base: dict | None, key: str) -> str:
    if not base or not s.get(key) or not base.get(key):
        return "—"
    return f"{s[key] / base[key]:.2f}×"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.router_policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--regimes",
        default="ample,tight",
        help="ample (1 GiB of KV per engine) and/or tight "
        "(--tight-blocks per engine) (default: %(default)s)",
    )
    ap.add_argument(
        "--tight-blocks",
        type=int,
        default=25,
        help="KV blocks per engine in the tight regime: one --max-model-len "
        "context (24 × 128 tokens) plus vLLM's null block, the least an "
        "engine starts with (default: %(default)s)",
    )
    ap.add_argument(
        "--contenders",
        default=",".join(c.name for c in CONTENDERS),
        help="router:policy list, in order (default: all: %(default)s); a Tandem "
        "variant adds router flags: tandem:cost+move-cost-factor=1.0",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per contender and regime, each with a fresh content salt "
        "(which pods hash-based policies pick changes with it); the "
        "table reports means and the hit-rate range (default 1)",
    )
    ap.add_argument(
        "--engines",
        type=int,
        default=2,
        help="engines per router (default 2). With 1 every policy sends "
        "everything to the one engine: the rows compare the front-end "
        "paths alone (Tandem's router + gRPC engine host vs a Rust "
        "router + vLLM's HTTP server)",
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router processes per contender (default 1); the replay sends "
        "requests to them in turn, as an Ingress does. Tandem's replicas "
        "share state through a redis-server this starts; the Rust "
        "routers' replicas share nothing",
    )
    ap.add_argument(
        "--kv-store",
        action="store_true",
        help="Tandem's engines share the KV store (Tandem contenders only: "
        "the Rust routers' vLLM servers run without one)",
    )
    ap.add_argument("--concurrency", type=int, default=4, help="agent lanes (default 4)")
    ap.add_argument("--sessions", type=int, default=4, help="sessions of the small profile")
    ap.add_argument("--turns-median", type=float, default=4, help="median turns per session")
    ap.add_argument("--seed", type=int, default=0, help="trace seed")
    ap.add_argument("--think-scale", type=float, default=0.2, help="think time multiplier")
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=MAX_MODEL_LEN,
        help=f"engines' context (the small profile compacts past {MAX_MODEL_LEN})",
    )
    ap.add_argument("--block-size", type=int, default=128, help="engines' KV block size")
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra vLLM flag for Tandem's engines (repeat; e.g. "
        "--engine-arg=--enable-logging-iteration-details, which logs each engine "
        "step's prompt chunks and decodes)",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    ap.add_argument("--out", help="output directory (default bench/results/<time>-policies)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    regimes = {"ample": Regime("ample", None), "tight": Regime("tight", a.tight_blocks)}
    chosen = [r for r in a.regimes.split(",") if r]
    by_name = {c.name: c for c in (*CONTENDERS, *EXTRA_CONTENDERS)}
    contenders = [c for c in a.contenders.split(",") if c]
    for name in contenders:
        if name not in by_name and (variant := parse_variant(name, by_name)):
            by_name[name] = variant
    unknown = [n for n in chosen if n not in regimes] + [c for c in contenders if c not in by_name]
    if min(a.repeat, a.engines, a.replicas) < 1:
        print("--repeat, --engines and --replicas must be at least 1", file=sys.stderr)
        return 2
    if a.kv_store and any(by_name[c].router != "tandem" for c in contenders if c in by_name):
        print("--kv-store: Tandem contenders only", file=sys.stderr)
        return 2
    if unknown:
        print(
            f"unknown regime(s)/contender(s): {unknown}; regimes: {sorted(regimes)}; "
            f"contenders: {sorted(by_name)}",
            file=sys.stderr,
        )
        return 2
    picked = [by_name[c] for c in contenders]
    for c in picked:  # fail before any engine starts
        if c.router != "tandem":
            find_binary(ROUTERS[c.router])
    out = Path(a.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-policies")
    bench = PolicyBench(a, out)
    interrupted = False
    try:
        with sigterm_as_interrupt():  # engines are stopped on the way out
            for name in chosen:
                regime = regimes[name]
                tandem = [c for c in picked if c.router == "tandem"]
                others = [c for c in picked if c.router != "tandem"]
                if tandem:
                    bench.tandem_runs(regime, tandem)
                if others:
                    bench.http_runs(regime, others)
    except KeyboardInterrupt:
        interrupted = True
        bench.problems.append("**interrupted**: the rows below are what ran before it")
    runs = bench.runs
    stats = bench.info["stats"]
    table = summary_table(runs, stats.get("reuse_bound_engine128"))
    notes = [
        f"Trace: small profile, {stats['sessions']} sessions, {stats['requests']} "
        f"requests, input p50 {stats['in_p50']:.0f} tokens; concurrency "
        f"{a.concurrency}; router replicas: {a.replicas}; engines: {a.engines} × "
        f"vLLM CPU, --max-model-len {a.max_model_len}, "
        f"tight = {a.tight_blocks} blocks of {a.block_size} tokens per engine, "
        f"ample = 1 GiB per engine.",
        *bench.problems,
    ]
    out.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        for rep in range(a.repeat):
            rows = [r for r in runs if r["regime"] == name and r["rep"] == rep]
            if rows:
                report.write_report(
                    rows,
                    run_dir(out, name, rep, a.repeat),
                    baseline=BASELINE,
                    title=f"Routing policies, {name} KV",
                    notes=notes,
                )
    md = out / "policies.md"
    md.write_text(
        "# Routing policies on the same engines\n\n" + table + "\n\n" + "\n\n".join(notes) + "\n"
    )
    print(table)
    log(f"report: {md}")
    if interrupted:
        return 130
    return 1 if bench.problems or any(r["summary"]["failures"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
