"""Discovery tests run against the fake Kubernetes API server (devcluster/)."""

from tests.kube.plugin import kube_api, kubectl  # noqa: F401
