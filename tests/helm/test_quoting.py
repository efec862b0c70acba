"""Names YAML could read as something else render as strings.

A release or namespace named `on`, `y`, `1e3` or `0123` is a valid Kubernetes
name, and unquoted in a label (`app.kubernetes.io/instance: on`) kubectl
reads it as a bool or a number and refuses the object. The chart quotes every
such value; these tests render it under such names, with every optional object
on and user-chosen names of the same kind, and read it as kubectl does
(chart.KubectlLoader).
"""

from __future__ import annotations

import pytest

from tests.helm.cases import FEATURES
from tests.helm.chart import by_kind, is_custom, one, pod_templates, problems, render

# Each a valid release and namespace name (a DNS-1123 label) that YAML reads as
# a bool, a number or null when unquoted.
TRICKY = ("on", "y", "no", "true", "null", "1e3", "0123", "123", "0x1f")

EVERYTHING = {
    **FEATURES["monitoring"],
    **FEATURES["network-policy-restricted"],
    **FEATURES["inference-pool"],
    **FEATURES["ingress-tls"],
    "router": {
        "apiKeys": {"existingSecret": "yes", "secretKey": "1e3"},
        "ingress": {"enabled": True, "className": "on", "host": "1e3", "tlsSecretName": "0123"},
    },
    "inferencePool": {"enabled": True, "endpointPicker": {"name": "off"}},
}


def string_maps(obj: dict) -> list[tuple[str, dict]]:
    """(where, map) for every label map and selector of an object."""
    found = [("metadata.labels", obj["metadata"].get("labels") or {})]
    for template in pod_templates(obj):
        found.append(("pod labels", template["metadata"].get("labels") or {}))
    selector = (obj.get("spec") or {}).get("selector")
    if isinstance(selector, dict):
        found.append(("spec.selector", selector.get("matchLabels", selector)))
    return found


@pytest.mark.parametrize("name", TRICKY)
def test_release_and_namespace_names_render_as_strings(name):
    docs = render(EVERYTHING, release=name, namespace=name)
    for doc in docs:
        ref = f"{doc['kind']}/{doc['metadata']['name']}"
        if "namespace" in doc["metadata"]:
            assert doc["metadata"]["namespace"] == name, ref
        for where, labels in string_maps(doc):
            for key, value in labels.items():
                assert isinstance(value, str), f"{ref} {where} {key}: {value!r}"
        if "app.kubernetes.io/instance" in doc["metadata"]["labels"]:
            assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == name, ref
        # Built-in kinds: the Kubernetes schema; ours: the CRD. Either refuses a
        # bool or a number where a string belongs (labels, selectors, names).
        if doc["kind"] in ("ServiceMonitor", "PodMonitor"):
            assert doc["spec"]["namespaceSelector"]["matchNames"] == [name], ref
        found = problems(doc)
        assert not found, "\n".join(found)
    spec = one(docs, "TandemDeployment")["spec"]
    assert spec["router"]["apiKeySecretRef"] == {"name": "yes", "key": "1e3"}
    assert spec["router"]["ingress"] == {
        "enabled": True,
        "className": "on",
        "host": "1e3",
        "tlsSecretName": "0123",
    }
    assert one(docs, "InferencePool")["spec"]["endpointPickerRef"]["name"] == "off"
    # Inside a longer string a name stays as it is: quoting there would add quotes.
    operator = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert f"--namespace={name}" in operator["args"]
    test_pod = one(docs, "Pod")["spec"]["containers"][0]
    assert f"--url=http://{name}-tandem-router.{name}.svc" in test_pod["args"]
    assert any(is_custom(d) for d in docs) and by_kind(docs, "NetworkPolicy")
