"""The LeaderWorkerSet v1 API (leaderworkerset.x-k8s.io/v1) as a structural
OpenAPI schema, written here by hand from LWS's documented API types (field
names, enums, defaults, minimums, status, subresources); LWS's own CRD is not
vendored. Pod templates are left open here and validated as Kubernetes
PodTemplates (kubernetes-validate).
"""

from __future__ import annotations

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"

_POD_TEMPLATE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_INT_OR_STRING = {"x-kubernetes-int-or-string": True}

SCHEMA = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "format": "int32", "minimum": 0, "default": 1},
                "startupPolicy": {
                    "type": "string",
                    "enum": ["LeaderCreated", "LeaderReady"],
                    "default": "LeaderCreated",
                },
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["workerTemplate"],
                    "properties": {
                        "leaderTemplate": _POD_TEMPLATE,
                        "workerTemplate": _POD_TEMPLATE,
                        "size": {"type": "integer", "format": "int32", "minimum": 1, "default": 1},
                        "restartPolicy": {
                            "type": "string",
                            "default": "RecreateGroupOnPodRestart",
                            "enum": [
                                "Default",
                                "RecreateGroupOnPodRestart",
                                "RecreateGroupAfterStart",
                                "None",
                            ],
                        },
                        "subGroupPolicy": {
                            "type": "object",
                            "properties": {
                                "subGroupPolicyType": {
                                    "type": "string",
                                    "enum": ["LeaderWorker", "LeaderExcluded"],
                                },
                                "subGroupSize": {"type": "integer", "format": "int32"},
                            },
                        },
                        "volumeClaimTemplates": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            },
                        },
                        "persistentVolumeClaimRetentionPolicy": {
                            "type": "object",
                            "properties": {
                                "whenDeleted": {"type": "string"},
                                "whenScaled": {"type": "string"},
                            },
                        },
                    },
                },
                "rolloutStrategy": {
                    "type": "object",
                    "properties": {
                        "type": {
                            "type": "string",
                            "enum": ["RollingUpdate"],
                            "default": "RollingUpdate",
                        },
                        "rollingUpdateConfiguration": {
                            "type": "object",
                            "properties": {
                                "partition": {"type": "integer", "format": "int32"},
                                "maxUnavailable": _INT_OR_STRING,
                                "maxSurge": _INT_OR_STRING,
                            },
                        },
                    },
                },
                "networkConfig": {
                    "type": "object",
                    "properties": {
                        "subdomainPolicy": {
                            "type": "string",
                            "enum": ["Shared", "UniquePerReplica"],
                        }
                    },
                },
            },
        },
        "status": {
            "type": "object",
            "properties": {
                "replicas": {"type": "integer", "format": "int32"},
                "readyReplicas": {"type": "integer", "format": "int32"},
                "updatedReplicas": {"type": "integer", "format": "int32"},
                "hpaPodSelector": {"type": "string"},
                "conditions": {
                    "type": "array",
                    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
            },
        },
    },
}

# As LWS's CRD declares them: `kubectl scale lws/NAME` and a status of its own.
SUBRESOURCES = {
    "status": {},
    "scale": {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.hpaPodSelector",
    },
}
