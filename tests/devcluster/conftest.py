"""The local cluster's own tests run against it through the shared fixtures."""

from tests.kube.plugin import kube_api, kube_api_with_controllers, kubectl  # noqa: F401
