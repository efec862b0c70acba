"""The other projects' custom resources the chart renders, as structural OpenAPI schemas.

Written here by hand from each project's documented API (field names, enums,
bounds, defaults), not copied from their CRDs, and covering the fields the
chart renders plus their close neighbours, so that a misspelt or misplaced
field is pruned (and reported) the way kube-apiserver would drop it:

* InferencePool, `inference.networking.k8s.io/v1` (the Gateway API Inference
  Extension's API reference);
* ServiceMonitor and PodMonitor, `monitoring.coreos.com/v1` (the Prometheus
  operator's API reference);
* Certificate and Issuer, `cert-manager.io/v1` (cert-manager's API reference);
* ScaledObject, `keda.sh/v1alpha1` (KEDA's ScaledObject specification);
* PodGroup, `scheduling.volcano.sh/v1beta1` (Volcano's PodGroup) and
  `scheduling.x-k8s.io/v1alpha1` (scheduler-plugins' coscheduling PodGroup);
* HTTPRoute, `gateway.networking.k8s.io/v1` (the Gateway API's reference);
* LeaderWorkerSet, `leaderworkerset.x-k8s.io/v1`: tests/operators/lws_schema.py.

`additionalProperties: false` marks objects whose every field is listed here,
so that the JSON Schema check refuses an unknown key even where pruning does
not reach. `crds()` wraps them as CustomResourceDefinitions for the fake API
server and for `tests.helm.chart.problems`.
"""

from __future__ import annotations

from typing import Any

from tests.operators import lws_schema

Schema = dict[str, Any]

_PORT_NUMBER: Schema = {"type": "integer", "format": "int32", "minimum": 1, "maximum": 65535}
_STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
# Prometheus' duration syntax, as the Prometheus operator's Duration type documents it.
_DURATION: Schema = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    r"(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_LABEL_SELECTOR: Schema = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string"},
                    "operator": {
                        "type": "string",
                        "enum": ["In", "NotIn", "Exists", "DoesNotExist"],
                    },
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_NAMESPACE_SELECTOR: Schema = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "any": {"type": "boolean"},
        "matchNames": {"type": "array", "items": {"type": "string"}},
    },
}
_RELABELINGS: Schema = {
    "type": "array",
    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
}
_INT_OR_STRING: Schema = {"x-kubernetes-int-or-string": True}
# One ServiceMonitor endpoint or PodMonitor podMetricsEndpoint.
_SCRAPE_ENDPOINT: Schema = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string"},
        "portNumber": {"type": "integer", "format": "int32", "minimum": 1, "maximum": 65535},
        "targetPort": _INT_OR_STRING,
        "path": {"type": "string"},
        "scheme": {"type": "string", "enum": ["http", "https", "HTTP", "HTTPS"]},
        "params": {
            "type": "object",
            "additionalProperties": {"type": "array", "items": {"type": "string"}},
        },
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "honorTimestamps": {"type": "boolean"},
        "enableHttp2": {"type": "boolean"},
        "followRedirects": {"type": "boolean"},
        "filterRunning": {"type": "boolean"},
        "relabelings": _RELABELINGS,
        "metricRelabelings": _RELABELINGS,
        "tlsConfig": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "authorization": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "basicAuth": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}


def _monitor_spec(endpoints_field: str, only_here: dict[str, Schema]) -> Schema:
    return {
        "type": "object",
        "required": ["selector"],
        "additionalProperties": False,
        "properties": {
            "selector": _LABEL_SELECTOR,
            "selectorMechanism": {"type": "string", "enum": ["RelabelConfig", "RoleSelector"]},
            "namespaceSelector": _NAMESPACE_SELECTOR,
            endpoints_field: {"type": "array", "items": _SCRAPE_ENDPOINT},
            "jobLabel": {"type": "string"},
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "sampleLimit": {"type": "integer", "format": "int64", "minimum": 0},
            "targetLimit": {"type": "integer", "format": "int64", "minimum": 0},
            "labelLimit": {"type": "integer", "format": "int64", "minimum": 0},
            "scrapeProtocols": {"type": "array", "items": {"type": "string"}},
            "attachMetadata": {"type": "object", "properties": {"node": {"type": "boolean"}}},
            **only_here,
        },
    }


SERVICE_MONITOR: Schema = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": _monitor_spec(
            "endpoints", {"targetLabels": {"type": "array", "items": {"type": "string"}}}
        )
    },
}

# A PodMonitor has no Service, so no targetLabels.
POD_MONITOR: Schema = {
    "type": "object",
    "required": ["spec"],
    "properties": {"spec": _monitor_spec("podMetricsEndpoints", {})},
}

INFERENCE_POOL: Schema = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts"],
            "additionalProperties": False,
            "properties": {
                # v1's selector is labels only (no matchExpressions).
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {"matchLabels": _STRING_MAP},
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "items": {
                        "type": "object",
                        "required": ["number"],
                        "additionalProperties": False,
                        "properties": {"number": _PORT_NUMBER},
                    },
                },
                "appProtocol": {
                    "type": "string",
                    "enum": ["http", "kubernetes.io/h2c"],
                    "default": "http",
                },
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string", "default": ""},
                        "kind": {"type": "string", "default": "Service"},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {
                            "type": "object",
                            "required": ["number"],
                            "additionalProperties": False,
                            "properties": {"number": _PORT_NUMBER},
                        },
                        "failureMode": {
                            "type": "string",
                            "enum": ["FailOpen", "FailClose"],
                            "default": "FailClose",
                        },
                    },
                },
            },
        },
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}

_ISSUER_REF: Schema = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "kind": {"type": "string"},
        "group": {"type": "string"},
    },
}
# The key usages cert-manager's KeyUsage type lists.
_KEY_USAGES = [
    "signing",
    "digital signature",
    "content commitment",
    "key encipherment",
    "key agreement",
    "data encipherment",
    "cert sign",
    "crl sign",
    "encipher only",
    "decipher only",
    "any",
    "server auth",
    "client auth",
    "code signing",
    "email protection",
    "s/mime",
    "ipsec end system",
    "ipsec tunnel",
    "ipsec user",
    "timestamping",
    "ocsp signing",
    "microsoft sgc",
    "netscape sgc",
]
_STRINGS: Schema = {"type": "array", "items": {"type": "string"}}

CERTIFICATE: Schema = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["secretName", "issuerRef"],
            "additionalProperties": False,
            "properties": {
                "secretName": {"type": "string", "minLength": 1},
                "issuerRef": _ISSUER_REF,
                "commonName": {"type": "string", "maxLength": 64},
                "dnsNames": _STRINGS,
                "ipAddresses": _STRINGS,
                "uris": _STRINGS,
                "emailAddresses": _STRINGS,
                "duration": {"type": "string"},
                "renewBefore": {"type": "string"},
                "renewBeforePercentage": {"type": "integer", "format": "int32"},
                "isCA": {"type": "boolean"},
                "usages": {"type": "array", "items": {"type": "string", "enum": _KEY_USAGES}},
                "privateKey": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "algorithm": {"type": "string", "enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "encoding": {"type": "string", "enum": ["PKCS1", "PKCS8"]},
                        "rotationPolicy": {"type": "string", "enum": ["Never", "Always"]},
                    },
                },
                "subject": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "secretTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"labels": _STRING_MAP, "annotations": _STRING_MAP},
                },
                "revisionHistoryLimit": {"type": "integer", "format": "int32", "minimum": 1},
            },
        },
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}

ISSUER: Schema = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            # One kind of issuer per object.
            "minProperties": 1,
            "maxProperties": 1,
            "properties": {
                "selfSigned": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"crlDistributionPoints": _STRINGS},
                },
                "ca": {
                    "type": "object",
                    "required": ["secretName"],
                    "additionalProperties": False,
                    "properties": {
                        "secretName": {"type": "string", "minLength": 1},
                        "crlDistributionPoints": _STRINGS,
                        "ocspServers": _STRINGS,
                        "issuingCertificateURLs": _STRINGS,
                    },
                },
                "acme": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "vault": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "venafi": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        },
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}


# KEDA's ScaledObject; its `advanced.horizontalPodAutoscalerConfig.behavior` is
# the HPA's own behavior, left open here (the HPA KEDA makes is checked by
# Kubernetes when KEDA writes it).
_KEDA_TRIGGER: Schema = {
    "type": "object",
    "required": ["type"],
    "additionalProperties": False,
    "properties": {
        "type": {"type": "string"},
        "name": {"type": "string"},
        "metadata": _STRING_MAP,
        "authenticationRef": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string"},
                "kind": {
                    "type": "string",
                    "enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"],
                },
            },
        },
        "metricType": {"type": "string", "enum": ["AverageValue", "Value", "Utilization"]},
        "useCachedMetrics": {"type": "boolean"},
    },
}
SCALED_OBJECT: Schema = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "format": "int32"},
                "cooldownPeriod": {"type": "integer", "format": "int32"},
                "initialCooldownPeriod": {"type": "integer", "format": "int32"},
                "idleReplicaCount": {"type": "integer", "format": "int32"},
                "minReplicaCount": {"type": "integer", "format": "int32"},
                "maxReplicaCount": {"type": "integer", "format": "int32"},
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "additionalProperties": False,
                    "properties": {
                        "failureThreshold": {"type": "integer", "format": "int32"},
                        "replicas": {"type": "integer", "format": "int32"},
                        "behavior": {
                            "type": "string",
                            "enum": [
                                "static",
                                "currentReplicas",
                                "currentReplicasIfHigher",
                                "currentReplicasIfLower",
                            ],
                        },
                    },
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "behavior": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                },
                            },
                        },
                        "scalingModifiers": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        },
                    },
                },
                "triggers": {"type": "array", "items": _KEDA_TRIGGER},
            },
        },
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}


_QUANTITY_MAP: Schema = {"type": "object", "additionalProperties": _INT_OR_STRING}
VOLCANO_POD_GROUP: Schema = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "minMember": {"type": "integer", "format": "int32", "minimum": 0},
                "minTaskMember": {
                    "type": "object",
                    "additionalProperties": {"type": "integer", "format": "int32"},
                },
                "queue": {"type": "string"},
                "priorityClassName": {"type": "string"},
                "minResources": _QUANTITY_MAP,
                "networkTopology": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        },
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}
COSCHEDULING_POD_GROUP: Schema = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "minMember": {"type": "integer", "format": "int32", "minimum": 0},
                "minResources": _QUANTITY_MAP,
                "scheduleTimeoutSeconds": {"type": "integer", "format": "int32"},
            },
        },
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}

# The Gateway API's Duration (GEP-2257) and hostname forms.
_GATEWAY_DURATION: Schema = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_HOSTNAME: Schema = {
    "type": "string",
    "minLength": 1,
    "maxLength": 253,
    "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}
_OBJECT_NAME: Schema = {"type": "string", "minLength": 1, "maxLength": 253}
_PARENT_REF: Schema = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "group": {"type": "string", "default": "gateway.networking.k8s.io"},
        "kind": {"type": "string", "default": "Gateway"},
        "namespace": {"type": "string"},
        "name": _OBJECT_NAME,
        "sectionName": {"type": "string"},
        "port": _PORT_NUMBER,
    },
}
_BACKEND_REF: Schema = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "group": {"type": "string", "default": ""},
        "kind": {"type": "string", "default": "Service"},
        "name": _OBJECT_NAME,
        "namespace": {"type": "string"},
        "port": _PORT_NUMBER,
        "weight": {"type": "integer", "format": "int32", "minimum": 0, "maximum": 1000000},
        "filters": {
            "type": "array",
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    },
    "x-kubernetes-validations": [
        {
            "rule": "(size(self.group) == 0 && self.kind == 'Service') ? has(self.port) : true",
            "message": "Must have port for Service reference",
        }
    ],
}
HTTP_ROUTE: Schema = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "parentRefs": {"type": "array", "maxItems": 32, "items": _PARENT_REF},
                "hostnames": {"type": "array", "maxItems": 16, "items": _HOSTNAME},
                "rules": {
                    "type": "array",
                    "maxItems": 16,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "matches": {
                                "type": "array",
                                "maxItems": 64,
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "path": {
                                            "type": "object",
                                            "additionalProperties": False,
                                            "properties": {
                                                "type": {
                                                    "type": "string",
                                                    "enum": [
                                                        "Exact",
                                                        "PathPrefix",
                                                        "RegularExpression",
                                                    ],
                                                    "default": "PathPrefix",
                                                },
                                                "value": {
                                                    "type": "string",
                                                    "maxLength": 1024,
                                                    "default": "/",
                                                },
                                            },
                                        },
                                        "headers": {
                                            "type": "array",
                                            "items": {
                                                "type": "object",
                                                "x-kubernetes-preserve-unknown-fields": True,
                                            },
                                        },
                                        "queryParams": {
                                            "type": "array",
                                            "items": {
                                                "type": "object",
                                                "x-kubernetes-preserve-unknown-fields": True,
                                            },
                                        },
                                        "method": {"type": "string"},
                                    },
                                },
                            },
                            "filters": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                },
                            },
                            "backendRefs": {"type": "array", "items": _BACKEND_REF},
                            "timeouts": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "request": _GATEWAY_DURATION,
                                    "backendRequest": _GATEWAY_DURATION,
                                },
                            },
                        },
                    },
                },
            },
        },
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}


def _crd(
    group: str,
    version: str,
    kind: str,
    plural: str,
    schema: Schema,
    subresources: dict[str, Any] | None = None,
) -> dict[str, Any]:
    served: dict[str, Any] = {
        "name": version,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
    }
    if subresources:
        served["subresources"] = subresources
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "plural": plural,
                "singular": kind.lower(),
                "listKind": f"{kind}List",
            },
            "versions": [served],
        },
    }


def crds() -> list[dict[str, Any]]:
    """Them all as CustomResourceDefinitions, as their projects install them."""
    lws_group, _, lws_version = lws_schema.API_VERSION.rpartition("/")
    return [
        _crd(
            lws_group,
            lws_version,
            lws_schema.KIND,
            "leaderworkersets",
            lws_schema.SCHEMA,
            lws_schema.SUBRESOURCES,
        ),
        _crd(
            "inference.networking.k8s.io", "v1", "InferencePool", "inferencepools", INFERENCE_POOL
        ),
        _crd("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors", SERVICE_MONITOR),
        _crd("monitoring.coreos.com", "v1", "PodMonitor", "podmonitors", POD_MONITOR),
        _crd("cert-manager.io", "v1", "Certificate", "certificates", CERTIFICATE),
        _crd("cert-manager.io", "v1", "Issuer", "issuers", ISSUER),
        _crd("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects", SCALED_OBJECT),
        _crd("scheduling.volcano.sh", "v1beta1", "PodGroup", "podgroups", VOLCANO_POD_GROUP),
        _crd("scheduling.x-k8s.io", "v1alpha1", "PodGroup", "podgroups", COSCHEDULING_POD_GROUP),
        _crd("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes", HTTP_ROUTE),
    ]
