"""`tandem`: run and inspect the embedded stack.

    tandem up        start the KV store, prefill and decode engines, and the router
                     (Ctrl-C stops them all)
    tandem down      stop a stack started by `tandem up` (from another shell)
    tandem status    what runs, and whether it is healthy
    tandem model     prepare the bundled model and print its folder
    tandem profile   profile one pool to saturation for the rate-matching controller
                     (`tandem profile --role prefill|decode|aggregated --url URL`)
    tandem cluster   up|down|status: a local cluster to try the operator and chart on
                     (a test bed, not a Kubernetes; devcluster/)
    tandem sim       run|sweep|validate: the cluster simulated at scales this machine cannot run,
                     the router's routing core inside, sweeps on Ray (sim/)

The benchmarks are not part of the product: in a checkout, `python -m bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from common import scheduler
from common.model import DEFAULT_MODEL_NAME
from common.procs import Proc, ProcessError, stop_process_groups
from services.router.chat_templates import CHATML_TOOLS
from services.stack import Stack, StackConfig, read_state, stop_tiers
from tandem import cluster

_DEFAULT_STATE = Path.home() / ".cache" / "tandem" / "run"
# The bundled SmolLM2's own chat template ignores `tools`: the router renders
# them with its shipped ChatML template and parses the calls (docs/api.md, "Tool calling").
BUNDLED_MODEL_ROUTER_ARGS = ["--chat-template", str(CHATML_TOOLS), "--tool-call-parser", "hermes"]


def _curl(url: str, model: str) -> str:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
        }
    )
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def cmd_up(args: argparse.Namespace) -> int:
    state = read_state(args.state_dir)
    if state and Proc(name="supervisor", argv=[], log="", pid=state["supervisor_pid"]).alive():
        print(
            f"a stack is already running (pid {state['supervisor_pid']}, "
            f"{state['router_url']}); `tandem down` stops it",
            file=sys.stderr,
        )
        return 1
    try:
        config = stack_config(args)
        config.validate()
    except ValueError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    stack = Stack(config)
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    store = "" if args.no_kv_store else "the KV store, "
    engines = f"{args.prefill} prefill + {args.decode} decode"
    if args.aggregated:
        engines += f" + {args.aggregated} aggregated"
    print(
        f"starting {store}{engines} engine(s) and the router; logs in {args.state_dir}", flush=True
    )
    try:
        stack.start()
    except (ProcessError, RuntimeError) as exc:
        print(f"tandem up failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    model = os.path.basename(os.path.normpath(args.model)) if args.model else DEFAULT_MODEL_NAME
    print(
        f"\nTandem is up: {stack.router_url}  (OpenAI API; metrics at {stack.router_url}/metrics)"
    )
    print(f"try:\n  {_curl(stack.router_url, model)}\n")
    print("Ctrl-C or `tandem down` stops everything.", flush=True)
    code = 0
    while not stopping:
        if dead := stack.dead():
            names = ", ".join(p.name for p in dead)
            print(
                f"{names} exited unexpectedly (see {dead[0].log}); stopping the stack",
                file=sys.stderr,
            )
            code = 1
            break
        time.sleep(0.5)
    print("stopping…", flush=True)
    stack.stop()
    print("stopped.")
    return code


def stack_config(args: argparse.Namespace) -> StackConfig:
    """The stack `tandem up` starts, from its flags (ValueError naming a bad flag)."""
    per_setting = {
        setting: scheduler.parse_per_pool(setting, text)
        for setting in scheduler.SETTINGS
        if (text := getattr(args, setting, None)) is not None
    }
    return StackConfig(
        model=args.model,
        prefill=args.prefill,
        decode=args.decode,
        aggregated=args.aggregated,
        router_port=args.port,
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len,
        state_dir=args.state_dir,
        engine_args=args.engine_arg or [],
        scheduler=scheduler.by_pool(per_setting),
        kv_store=not args.no_kv_store,
        kv_store_pool=args.kv_store_pool,
        kv_store_disk=args.kv_store_disk,
        router_args=[] if args.model else BUNDLED_MODEL_ROUTER_ARGS,
    )


def cmd_down(args: argparse.Namespace) -> int:
    state = read_state(args.state_dir)
    if state is None:
        print("no stack is running")
        return 0
    supervisor = Proc(name="supervisor", argv=[], log="", pid=state["supervisor_pid"])
    if supervisor.alive():
        os.kill(supervisor.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while supervisor.alive() and time.monotonic() < deadline:
            time.sleep(0.3)
    # Whatever the supervisor did not stop (it was killed, say) goes now.
    for tier in stop_tiers(Proc(**raw) for raw in state["procs"]):
        stop_process_groups(tier, grace_s=10)
    (args.state_dir / "stack.json").unlink(missing_ok=True)
    print("stopped.")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import grpc
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    state = read_state(args.state_dir)
    if state is None:
        print("no stack is running")
        return 3
    ok = True
    print(f"{'NAME':<12} {'PID':>7}  {'PROCESS':<8} {'HEALTH':<12} ADDRESS")
    for raw in state["procs"]:
        proc = Proc(**raw)
        alive = proc.alive()
        health = "-"
        if alive and proc.grpc:
            try:
                with grpc.insecure_channel(proc.grpc) as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=2
                    )
                health = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                health = exc.code().name
        elif alive and proc.url and proc.name in ("router", "kvstore"):
            try:
                health = str(httpx.get(f"{proc.url}/health", timeout=2).status_code)
                health = "SERVING" if health == "200" else f"HTTP {health}"
            except httpx.HTTPError as exc:
                health = type(exc).__name__
        ok &= alive and health == "SERVING"
        print(
            f"{proc.name:<12} {proc.pid or '-':>7}  {'running' if alive else 'dead':<8} "
            f"{health:<12} {proc.grpc or proc.url}"
        )
    return 0 if ok else 1


def cmd_model(args: argparse.Namespace) -> int:
    from common.model import main as model_main

    return model_main(args.rest)


# Whoever types `tandem bench` learns where the benchmarks are.
BENCH_MOVED = (
    "tandem bench: the benchmarks are not part of the installed product; in a "
    "checkout of the repository run `python -m bench` (dependencies: "
    "pip install -e '.[bench]'). Profiling a pool is `tandem profile`."
)


def cmd_bench(args: argparse.Namespace) -> int:
    print(BENCH_MOVED, file=sys.stderr)
    return 2


def cmd_profile(args: argparse.Namespace) -> int:
    from tandem.profile import main as profile_main

    return profile_main(args.rest)


def cmd_sim(args: argparse.Namespace) -> int:
    from sim.cli import main as sim_main

    return sim_main(args.rest)


def cmd_operator(args: argparse.Namespace) -> int:
    from operators.__main__ import main as operator_main
    from sim.check import SimulationChecker

    # The operator checks scaling decisions with the simulator when a
    # TandemDeployment asks (scaling.simulation); operators cannot import sim.
    return operator_main(args.rest, simulator=SimulationChecker())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=_DEFAULT_STATE,
        help="where the running stack's state and logs live (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser(
        "up",
        help="start the embedded stack (foreground; Ctrl-C stops it)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    up.add_argument(
        "--model",
        default=None,
        help="local Hugging Face model folder (default: bundled SmolLM2-135M-Instruct)",
    )
    up.add_argument("--port", type=int, default=8000, help="router HTTP port")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill engines")
    up.add_argument("--decode", type=int, default=1, help="number of decode engines")
    up.add_argument(
        "--aggregated",
        type=int,
        default=0,
        help="number of aggregated engines (whole requests, no P/D split)",
    )
    up.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache per engine (GiB, CPU)")
    up.add_argument("--max-model-len", type=int, default=8192, help="context length")
    up.add_argument(
        "--no-kv-store",
        action="store_true",
        help="run without the shared KV store (services/kvstore); engines "
        "then keep prefixes only in their own KV cache",
    )
    up.add_argument(
        "--kv-store-pool", default="2GB", help="KV store RAM pool size (default: %(default)s)"
    )
    up.add_argument(
        "--kv-store-disk",
        default="8GB",
        help="KV store disk tier size, under --state-dir (default: %(default)s)",
    )
    up.add_argument(
        "--engine-arg",
        action="append",
        metavar="ARG",
        help="extra vLLM engine flag for every engine (repeat; e.g. --engine-arg=--block-size=64)",
    )
    pools = up.add_argument_group(
        "scheduler settings per pool",
        "vLLM's scheduler flags, by pool: VALUE sets every pool, POOL=VALUE[,POOL=VALUE] "
        f"the pools named ({', '.join(scheduler.POOLS)}); e.g. "
        "--long-prefill-token-threshold prefill=2048,decode=512. Unset: vLLM's default. "
        "(vLLM's --prefill-schedule-interval is not offered: it acts only across the "
        "data-parallel ranks of a mixture-of-experts engine, which the embedded stack "
        "never runs.)",
    )
    for setting in scheduler.SETTINGS:
        boolean = scheduler.is_boolean(setting)
        pools.add_argument(
            scheduler.flag_name(setting),
            dest=setting,
            default=argparse.SUPPRESS,
            metavar="[POOL=]BOOL" if boolean else "[POOL=]N",
            nargs="?" if boolean else None,
            const="true" if boolean else None,
            help=scheduler.describe(setting),
        )
    up.set_defaults(func=cmd_up)

    sub.add_parser("down", help="stop the running stack").set_defaults(func=cmd_down)
    sub.add_parser("status", help="show processes and health").set_defaults(func=cmd_status)
    model = sub.add_parser("model", help="prepare the bundled model and print its folder")
    model.add_argument("rest", nargs=argparse.REMAINDER)
    model.set_defaults(func=cmd_model)
    bench = sub.add_parser("bench", help="moved: `python -m bench` in a checkout", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    profile = sub.add_parser(
        "profile",
        help="profile one pool for the rate-matching controller (tandem/profile.py)",
        add_help=False,
    )
    profile.add_argument("rest", nargs=argparse.REMAINDER)
    profile.set_defaults(func=cmd_profile)
    operator = sub.add_parser(
        "operator", help="run the Kubernetes operator (operators/)", add_help=False
    )
    operator.add_argument("rest", nargs=argparse.REMAINDER)
    operator.set_defaults(func=cmd_operator)
    simulate = sub.add_parser(
        "sim", help="simulate the cluster: run|sweep (sim/README.md)", add_help=False
    )
    simulate.add_argument("rest", nargs=argparse.REMAINDER)
    simulate.set_defaults(func=cmd_sim)
    cluster.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # whatever follows, --help included, gets the same answer
        return cmd_bench(argparse.Namespace(rest=argv[1:]))
    if argv[:1] == ["profile"]:  # everything after `profile` is its own, --help included
        return cmd_profile(argparse.Namespace(rest=argv[1:]))
    if argv[:1] == ["sim"]:  # likewise the simulator's
        return cmd_sim(argparse.Namespace(rest=argv[1:]))
    if argv[:1] == ["operator"]:  # likewise the operator's flags
        return cmd_operator(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
