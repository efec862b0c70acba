"""`python -m operators` / `tandem operator`: run the Tandem Kubernetes operator."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

DESCRIPTION = """\
Tandem's Kubernetes operator (kopf). It turns each TandemDeployment
(tandem.dev/v1alpha1, `kubectl get td`) into the router Deployment/Service/
Ingress/PodDisruptionBudget, Redis, the Mooncake KV store (master + one
store client per engine node), one EnginePool per role and each pool's
engines (a Deployment, or a LeaderWorkerSet running vLLM's Ray executor when
a replica spans nodes) with a headless Service. `kubectl scale
enginepool/<td>-decode --replicas N` sizes a pool; before a scale-down the
operator marks the pods the routers report cheapest to lose with
controller.kubernetes.io/pod-deletion-cost. Install the CRDs
(operators/crds/) and RBAC (operators/rbac/) first.

Outside a cluster it reads the kubeconfig in $KUBECONFIG (or --kubeconfig);
inside, its service account.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem operator", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                        help="kubeconfig file (default: $KUBECONFIG; in a pod: the service "
                        "account)")
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="watch only this namespace (repeatable; a glob such as "
                        "'team-*' works); default: every namespace")
    parser.add_argument("--health-port", type=int, default=8080,
                        help="liveness endpoint http://0.0.0.0:PORT/healthz (kopf's)")
    parser.add_argument("--metrics-port", type=int, default=9090,
                        help="Prometheus /metrics port (0 = off)")
    parser.add_argument("--resync-seconds", type=float, default=30.0,
                        help="how often every TandemDeployment is compared again in full "
                        "(besides every change it, its pools or its objects see)")
    parser.add_argument("--scaling-seconds", type=float, default=15.0,
                        help="how often the rate-matching controller decides for each "
                        "TandemDeployment whose scaling.mode is Recommend or Auto")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig
    os.environ["TANDEM_OPERATOR_RESYNC_SECONDS"] = str(args.resync_seconds)
    os.environ["TANDEM_OPERATOR_SCALING_SECONDS"] = str(args.scaling_seconds)

    import kopf
    from prometheus_client import start_http_server

    from common.logs import setup_logging
    from operators import handlers  # noqa: F401  (registers the handlers)

    setup_logging("operator")
    # kopf logs what it does (handlers, retries, watch errors) on its own logger.
    operators_logger, kopf_logger = logging.getLogger("operators"), logging.getLogger("kopf")
    kopf_logger.handlers[:] = operators_logger.handlers
    kopf_logger.setLevel(operators_logger.level)
    kopf_logger.propagate = False
    if args.metrics_port:
        start_http_server(args.metrics_port)
    asyncio.run(kopf.operator(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz",
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
