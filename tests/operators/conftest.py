from tests.kube.plugin import kube_api, kube_api_with_controllers, kubectl  # noqa: F401
