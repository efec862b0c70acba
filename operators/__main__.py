"""`python -m operators` / `tandem operator`: run the Tandem Kubernetes operator."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from common.settings import SettingError, add_arguments, from_arguments
from operators.planner.simulate import Simulator
from operators.settings import ENV_PREFIX, OperatorSettings

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

Run two replicas or more: they elect a leader over a coordination.k8s.io
Lease (--lease-name); only the leader reconciles, the others stand by and
one takes over within --lease-duration-seconds when the leader dies, at once
when it stops cleanly.

Outside a cluster it reads the kubeconfig in $KUBECONFIG (or --kubeconfig);
inside, its service account. Every flag also reads an environment variable
TANDEM_OPERATOR_<FLAG>.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem operator",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, OperatorSettings, ENV_PREFIX)
    return parser


def main(argv: list[str] | None = None, simulator: Simulator | None = None) -> int:
    """`simulator`: what checks scaling decisions by simulation
    (`scaling.simulation`); the launcher gives sim's, `python -m operators` none."""
    try:
        parser = build_parser()
    except SettingError as exc:  # a bad value in the environment
        raise SystemExit(f"tandem operator: error: {exc}") from None
    try:
        settings: OperatorSettings = from_arguments(OperatorSettings, parser.parse_args(argv))
    except SettingError as exc:
        parser.error(str(exc))
    if settings.kubeconfig:
        # kopf's own login (kopf.login_with_kubeconfig) reads only the environment.
        os.environ["KUBECONFIG"] = settings.kubeconfig

    from prometheus_client import start_http_server

    from common.logs import setup_logging
    from operators.process import run

    setup_logging("operator")
    # kopf logs what it does (handlers, retries, watch errors) on its own logger.
    operators_logger, kopf_logger = logging.getLogger("operators"), logging.getLogger("kopf")
    kopf_logger.handlers[:] = operators_logger.handlers
    kopf_logger.setLevel(operators_logger.level)
    kopf_logger.propagate = False
    if settings.metrics_port:
        start_http_server(settings.metrics_port)
    return asyncio.run(run(settings, simulator))


if __name__ == "__main__":
    sys.exit(main())
