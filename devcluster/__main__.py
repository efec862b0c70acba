"""`python -m devcluster`: the local API server, on loopback, until stopped."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from devcluster import DEFAULT_STATE_DIR

DESCRIPTION = """\
A local stand-in for Kubernetes, for trying and testing Tandem on one machine.

It is a test bed, NOT a Kubernetes: one process serving the Kubernetes API
(version 1.32, plain HTTP on loopback, no authentication) from memory, with
the semantics Tandem's operator, its Helm chart and kubectl rely on
(resourceVersions, watches, CRD validation with CEL, garbage collection,
namespaces), and the controllers Tandem relies on: Deployments get
ReplicaSets and pods (scale-down honours pod-deletion-cost), DaemonSets and
LeaderWorkerSets their pods, Services their EndpointSlices, all bound to one
node (devcluster-node). Nothing it stores survives it. devcluster/README.md
lists what it does and what it does not.

A process kubelet runs the pods bound to that node as local processes (the
project's venv stands in for Tandem's images), each pod in a network
namespace of its own on a bridge, with Services on ClusterIPs and on
loopback ports it prints. It needs root; --no-kubelet serves without pods.

It starts with Tandem's CRDs installed (operators/crds/, or --crds), writes a
kubeconfig for kubectl, kopf and Kubernetes clients, prints where, and runs
until Ctrl-C or SIGTERM.
"""


def tandem_crds() -> list[Path]:
    """Tandem's CRD files, found beside the operators package without importing it
    (the local cluster is no part of Tandem's control plane)."""
    spec = importlib.util.find_spec("operators")
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(next(iter(spec.submodule_search_locations))) / "crds"
    return sorted(folder.glob("*.yaml"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m devcluster",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--port",
        type=int,
        default=0,
        help="loopback port to serve on (default: a free one, printed)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="where the kubeconfig is written (default: %(default)s)",
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        help="write the kubeconfig here instead (default: STATE_DIR/kubeconfig)",
    )
    parser.add_argument(
        "--namespace",
        default="default",
        help="the kubeconfig context's namespace, created if missing (default: %(default)s)",
    )
    parser.add_argument(
        "--crds",
        type=Path,
        action="append",
        metavar="FILE_OR_DIR",
        help="CRD manifests to install at start instead of Tandem's (repeatable)",
    )
    parser.add_argument(
        "--no-controllers",
        action="store_true",
        help="run the API server alone: nothing acts on what is written (no pods, no "
        "EndpointSlices, no status)",
    )
    parser.add_argument(
        "--no-kubelet",
        action="store_true",
        help="serve the API only: no pods run, no pod network (needs no root)",
    )
    parser.add_argument(
        "--pod-cidr",
        default="10.250.0.0/16",
        help="pods take addresses from its lower half, Services from its upper half "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--bridge", default="tandem0", help="the pod network's bridge (default: %(default)s)"
    )
    parser.add_argument(
        "--engine-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment for engine pods (label app.kubernetes.io/component=engine), "
        "under their own (repeatable; `tandem cluster up` passes the embedded stack's)",
    )
    return parser


def crd_files(paths: list[Path] | None) -> list[Path]:
    if paths is None:
        return tandem_crds()
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(path.glob("*.yaml")))
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"python -m devcluster: error: no such file or folder: {path}")
    return files


async def serve(args: argparse.Namespace, crds: list[Path]) -> None:
    import kmock

    from devcluster.apiserver import (
        SERVER_VERSION,
        FakeApiServer,
        load_yaml_documents,
        write_kubeconfig,
    )
    from devcluster.store import ApiError

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    handler = FakeApiServer(
        keep_requests=False, pod_log_dir=None if args.no_kubelet else args.state_dir / "logs"
    )
    kubeconfig: Path = args.kubeconfig or args.state_dir / "kubeconfig"
    async with (
        handler,
        kmock.Server(handler, host="127.0.0.1", port=args.port or None) as server,
        kubelet_running(args, str(server.url).rstrip("/")) as kubelet,
    ):
        handler.install(*load_yaml_documents(*crds))
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": args.namespace}}
        try:
            handler.install(namespace)
        except ApiError as exc:
            if exc.status != 409:  # AlreadyExists is fine
                raise
        controllers = None
        if not args.no_controllers:
            from devcluster.controllers import ControllerManager

            controllers = ControllerManager(handler.store)
            controllers.start()
        url = str(server.url).rstrip("/")
        kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        write_kubeconfig(url, kubeconfig, args.namespace)
        print(
            f"devcluster: Kubernetes {SERVER_VERSION['major']}.{SERVER_VERSION['minor']} API "
            f"at {url} (a test bed, not a Kubernetes), {len(crds)} CRD file(s) installed, "
            f"controllers {'off' if controllers is None else 'on'}\n"
            f"kubeconfig: {kubeconfig}\n"
            f"  export KUBECONFIG={kubeconfig}\n"
            f"Ctrl-C or SIGTERM stops it; what it stores goes with it.",
            flush=True,
        )
        if kubelet is not None:
            print(
                f"kubelet: node {kubelet.node}, pods on {kubelet.network.bridge} "
                f"{kubelet.network.net}, API for pods at https://{kubelet.network.gateway}:443, "
                f"Services' loopback ports in {kubelet.services.state_file}",
                flush=True,
            )
        try:
            await stop.wait()
        finally:
            kubeconfig.unlink(missing_ok=True)
            if controllers is not None:
                await controllers.stop()
    print("devcluster: stopped", flush=True)


@contextlib.asynccontextmanager
async def kubelet_running(args: argparse.Namespace, url: str) -> AsyncIterator[Any]:
    """The process kubelet and the pod network, stopped (no process, namespace
    or link left) when the server stops; None with --no-kubelet."""
    if args.no_kubelet:
        yield None
        return
    from devcluster.kubelet.kubelet import Kubelet

    engine_env = {}
    for item in args.engine_env:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"python -m devcluster: error: --engine-env {item!r}: NAME=VALUE")
        engine_env[name] = value
    kubelet = Kubelet(
        url, args.state_dir, pod_cidr=args.pod_cidr, bridge=args.bridge, engine_env=engine_env
    )
    await kubelet.start()
    try:
        yield kubelet
    finally:
        await kubelet.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported here: --help answers without loading the server's dependencies.
    from devcluster.kubelet.network import NetworkError
    from devcluster.store import ApiError

    try:
        asyncio.run(serve(args, crd_files(args.crds)))
    except ApiError as exc:  # a CRD or the namespace refused
        raise SystemExit(f"python -m devcluster: error: {exc.message}") from None
    except NetworkError as exc:  # not root, no iproute2, a bridge left behind
        raise SystemExit(f"python -m devcluster: error: {exc}") from None
    except OSError as exc:  # the port is taken, the state dir not writable
        raise SystemExit(f"python -m devcluster: error: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
