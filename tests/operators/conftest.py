from tests.kube.plugin import kube_api, kubectl  # noqa: F401
