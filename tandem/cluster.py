"""`tandem cluster up|down|status`: the local cluster (devcluster/) in the background.

`up` starts `python -m devcluster` in a process group of its own, waits until
it has written its kubeconfig, records it in STATE_DIR/cluster.json and
prints how to point kubectl at it; it runs pods (the process kubelet and pod
network, as root; `--no-kubelet` not), engine pods with the embedded stack's
CPU settings. `down` stops it (SIGTERM, then SIGKILL to the group after a
grace period): no pod process, network namespace or link stays; `status`
says whether it runs and answers.
It is a test bed, not a Kubernetes (`python -m devcluster --help`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common.procs import Proc, launch, stop_process_group
from devcluster import DEFAULT_STATE_DIR

STATE_FILE = "cluster.json"
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 20.0


def read_state(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / STATE_FILE).read_text())
    except FileNotFoundError:
        return None


def _running(state: dict | None) -> Proc | None:
    if state is None:
        return None
    proc = Proc(name="devcluster", argv=[], log=state["log"], pid=state["pid"])
    return proc if proc.alive() else None


def cmd_up(args: argparse.Namespace) -> int:
    state_dir: Path = args.cluster_dir
    running = _running(state := read_state(state_dir))
    if running is not None and state is not None:
        print(
            f"tandem cluster: already running at {state['url']} (pid {running.pid}); "
            f"`tandem cluster down` stops it",
            file=sys.stderr,
        )
        return 1
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "devcluster", "--state-dir", str(state_dir)]
    if args.port:
        argv += ["--port", str(args.port)]
    if args.no_controllers:
        argv.append("--no-controllers")
    if args.no_kubelet:
        argv.append("--no-kubelet")
    else:
        argv += ["--pod-cidr", args.pod_cidr, "--bridge", args.bridge]
        # Engine pods get the CPU settings the embedded stack gives its engines:
        # unbound, one OpenMP thread each, so more engines than cores still start.
        from services.stack import StackConfig, engine_env

        for name, value in engine_env(StackConfig.kv_cache_gib, None).items():
            argv += ["--engine-env", f"{name}={value}"]
    log = state_dir / "devcluster.log"
    proc, popen = launch("devcluster", argv, log, env={"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + START_TIMEOUT_S
    while "export KUBECONFIG=" not in (text := log.read_text(errors="replace")):
        if popen.poll() is not None:
            print(f"tandem cluster: it exited during start-up:\n{text[-3000:]}", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            stop_process_group(proc, STOP_GRACE_S)
            print(
                f"tandem cluster: not up after {START_TIMEOUT_S:.0f}s; see {log}", file=sys.stderr
            )
            return 1
        time.sleep(0.2)
    url = next(word for word in text.split() if word.startswith("http://"))
    kubeconfig = state_dir / "kubeconfig"
    services = None if args.no_kubelet else str(state_dir / "services.json")
    (state_dir / STATE_FILE).write_text(
        json.dumps(
            {
                "pid": proc.pid,
                "url": url,
                "kubeconfig": str(kubeconfig),
                "log": str(log),
                "services": services,
            }
        )
    )
    pods = (
        "no pods run (--no-kubelet)"
        if services is None
        else f"pods run here; Services' loopback ports are in the log and in {services}"
    )
    print(
        f"local cluster at {url} (a test bed, not a Kubernetes; pid {proc.pid}, log {log})\n"
        f"  export KUBECONFIG={kubeconfig}\n"
        f"{pods}\n"
        f"`tandem cluster down` stops it."
    )
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    state_file = args.cluster_dir / STATE_FILE
    state = read_state(args.cluster_dir)
    running = _running(state)
    if running is None:
        state_file.unlink(missing_ok=True)
        print("no local cluster is running")
        return 0
    stop_process_group(running, STOP_GRACE_S)
    state_file.unlink(missing_ok=True)
    print("stopped.")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    state = read_state(args.cluster_dir)
    running = _running(state)
    if running is None or state is None:
        print("no local cluster is running")
        return 1
    try:
        version = httpx.get(f"{state['url']}/version", timeout=5).json()["gitVersion"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        print(f"running (pid {running.pid}) at {state['url']} but not answering: {exc!r}")
        return 1
    print(
        f"running (pid {running.pid}) at {state['url']}, Kubernetes {version}\n"
        f"  export KUBECONFIG={state['kubeconfig']}"
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    cluster = sub.add_parser(
        "cluster",
        help="a local cluster for trying the operator and chart (a test bed, not a Kubernetes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = cluster.add_subparsers(dest="action", required=True)
    for name, func, text in (
        ("up", cmd_up, "start it in the background and print its kubeconfig"),
        ("down", cmd_down, "stop it"),
        ("status", cmd_status, "whether it runs and answers"),
    ):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument(
            "--state-dir",
            metavar="DIR",
            dest="cluster_dir",  # not the stack's --state-dir of `tandem` itself
            type=Path,
            default=DEFAULT_STATE_DIR,
            help="its kubeconfig, log and state (default: %(default)s)",
        )
        if name == "up":
            action.add_argument(
                "--port", type=int, default=0, help="loopback port (default: a free one)"
            )
            action.add_argument(
                "--no-controllers",
                action="store_true",
                help="the API server alone: no pods for Deployments, no EndpointSlices",
            )
            action.add_argument(
                "--no-kubelet",
                action="store_true",
                help="the API server only: no pods run, no pod network (root not needed)",
            )
            action.add_argument(
                "--pod-cidr",
                default="10.250.0.0/16",
                help="pods' and Services' addresses (default: %(default)s)",
            )
            action.add_argument(
                "--bridge",
                default="tandem0",
                help="the pod network's bridge (default: %(default)s)",
            )
        action.set_defaults(func=func)
