"""The local cluster (devcluster/) as a pytest fixture: `tandem cluster up`
on the test module's own bridge and addresses, `down` afterwards. Starting
one needs root (the process kubelet makes network namespaces): without it
`up` fails, and the test with it, naming why."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.harness import cluster_down, cluster_up
from devcluster.client import LocalCluster


def cluster_fixture(bridge: str, pod_cidr: str, scope: str = "function") -> Any:
    """A pytest fixture (assign it to a module-level name) that brings a local
    cluster up on the bridge and addresses of its test module's own (a user's
    cluster and other tests may run beside it) and down afterwards."""

    @pytest.fixture(scope=scope)
    def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
        state = tmp_path_factory.mktemp("cluster")
        try:
            running = cluster_up(state, bridge, pod_cidr)
            yield running
            running.close()
        finally:
            cluster_down(state)

    return cluster
