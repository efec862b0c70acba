"""The values the chart is rendered with in tests: its defaults, the example files,
and each optional feature switched on."""

from __future__ import annotations

from tests.helm.chart import EXAMPLES, example

# Every values file under helm/examples/, so a new example is rendered and admitted
# (CEL rules included) like the others without being listed here.
EXAMPLE_NAMES = tuple(sorted(p.stem for p in EXAMPLES.glob("*.yaml")))

FEATURES: dict[str, dict] = {
    "monitoring": {
        "monitoring": {
            "enabled": True,
            "labels": {"release": "kube-prometheus-stack"},
            "engines": {"interval": "5s", "scrapeTimeout": "4s"},
            "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}},
        }
    },
    "network-policy": {"networkPolicy": {"enabled": True}},
    "network-policy-restricted": {
        "networkPolicy": {
            "enabled": True,
            "routerFrom": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}
                    }
                }
            ],
            "metricsFrom": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                    }
                }
            ],
        }
    },
    "inference-pool": {
        "inferencePool": {"enabled": True, "endpointPicker": {"name": "tandem-epp"}}
    },
    "inference-pool-engines": {
        "inferencePool": {
            "enabled": True,
            "selects": "engines",
            "endpointPicker": {"name": "tandem-epp", "port": 9002, "failureMode": "FailOpen"},
        }
    },
    "external-redis": {"redis": {"managed": False, "url": "rediss://redis.cache.svc:6380/0"}},
    "multi-node": {
        "decode": {
            "nodesPerReplica": 2,
            "gpusPerPod": 8,
            "parallelism": {"tensor": 8, "pipeline": 2},
        }
    },
    "rdma": {"rdma": {"enabled": True, "env": [{"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"}]}},
    "api-keys": {"router": {"apiKeys": {"keys": ["sk-test-0001", "sk-test-0002"]}}},
    "ingress-tls": {
        "router": {
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "host": "llm.example.com",
                "tlsSecretName": "llm-tls",
            }
        }
    },
    "model-volume": {
        "model": {"path": "/models/llama", "volume": {"persistentVolumeClaim": "llama-weights"}}
    },
    "model-hf-cache": {
        "model": {
            "source": "hf://Qwen/Qwen3-8B@9c1d2a7",
            "cache": {"create": True, "size": "50Gi", "storageClassName": "fast-rwx"},
            "hfToken": {"existingSecret": "hf-token"},
            "downloadBackoffLimit": 5,
            "hubEndpoint": "http://hub-mirror.models.svc:8080",
        }
    },
    "model-hf-existing-claim": {
        "model": {"source": "hf://meta-llama/Llama-3.1-8B", "cache": {"existingClaim": "weights"}}
    },
    "model-pvc": {"model": {"source": "pvc://weights/llama-3.1-8b"}},
    "model-hf-token-value": {
        "model": {
            "source": "hf://meta-llama/Llama-3.1-8B",
            "cache": {"create": True},
            "hfToken": {"token": "hf_0123456789abcdef"},
        }
    },
    "decode-spread-and-scheduler": {
        "decode": {"spreadAcrossNodes": True, "schedulerName": "volcano"}
    },
    "autoscaling-keda": {
        "autoscaling": {
            "decode": {
                "type": "keda",
                "minReplicas": 1,
                "maxReplicas": 6,
                "pollingInterval": 15,
                "triggers": [
                    {
                        "type": "prometheus",
                        "metadata": {
                            "serverAddress": "http://prometheus.monitoring:9090",
                            "query": 'sum(tandem_router_pod_in_flight{role="decode"})',
                            "threshold": "32",
                        },
                    }
                ],
            }
        }
    },
    "autoscaling-hpa": {
        "scaling": {"mode": "Recommend", "profiles": {"prefill": "p", "decode": "d"}},
        "autoscaling": {
            "prefill": {
                "type": "hpa",
                "minReplicas": 1,
                "maxReplicas": 4,
                "metrics": [
                    {
                        "type": "Pods",
                        "pods": {
                            "metric": {"name": "vllm_num_requests_waiting"},
                            "target": {"type": "AverageValue", "averageValue": "4"},
                        },
                    }
                ],
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
            }
        },
    },
    "pod-groups-volcano": {
        "podGroups": {"type": "volcano", "queue": "inference"},
        "prefill": {"schedulerName": "volcano", "minReplicas": 2, "replicas": 2},
        "decode": {
            "schedulerName": "volcano",
            "nodesPerReplica": 2,
            "gpusPerPod": 8,
            "parallelism": {"tensor": 8, "pipeline": 2},
        },
    },
    "pod-groups-coscheduling": {
        "podGroups": {"type": "coscheduling", "scheduleTimeoutSeconds": 120},
        "prefill": {"schedulerName": "scheduler-plugins-scheduler"},
        "decode": {"schedulerName": "scheduler-plugins-scheduler"},
    },
    "watch-all-namespaces": {"operator": {"watchAllNamespaces": True}},
    "scaling-auto": {
        "scaling": {"mode": "Auto", "gpuBudget": 8, "slo": {"ttftP90Ms": 1500, "itlP90Ms": 40}}
    },
    # Every key of the CRD's scaling block, through values.
    "scaling-every-key": {
        "model": {"maxModelLen": 65536},
        "scaling": {
            "mode": "Recommend",
            "gpuBudget": 8,
            "profiles": {"prefill": "qwen-prefill", "decode": "qwen-decode"},
            "headroom": 1.5,
            "slo": {"ttftP90Ms": 2000, "interactivityP90": 20.5, "longestContextTokens": 32768},
            "capacity": {
                "layers": 36,
                "kvKind": "gqa",
                "kvHeads": 8,
                "headDim": 128,
                "kvBytes": 2,
                "gpuFreeGiB": 40.5,
                "sequences": 2,
            },
            "upCooldownSeconds": 30,
            "downCooldownSeconds": 900,
            "downWindowSeconds": 600,
            "maxStep": 1,
            "historyLimit": 20,
            "prometheus": {
                "url": "http://prometheus.monitoring:9090",
                "selector": 'namespace="serving"',
                "windowSeconds": 120,
            },
        },
    },
    "aggregated-pool": {
        "aggregated": {
            "replicas": 1,
            "minReplicas": 0,
            "maxReplicas": 4,
            "gpusPerPod": 2,
            "parallelism": {"tensor": 2},
            "engineArgs": ["--max-num-seqs=128"],
            "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        },
        "scaling": {"profiles": {"aggregated": "qwen-aggregated"}},
        "rdma": {"enabled": True},
    },
    "grpc-tls": {"grpcTls": {"enabled": True}},
    "grpc-tls-cluster-issuer": {
        "grpcTls": {
            "enabled": True,
            "serverName": "engines.llm.internal",
            "certManager": {
                "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"},
                "duration": "720h",
                "renewBefore": "240h",
            },
        }
    },
    "grpc-tls-existing-secret": {"grpcTls": {"enabled": True, "existingSecret": "llm-grpc-tls"}},
    "no-kv-store": {"kvStore": {"enabled": False}},
    # Every pod option of a pool, on a multi-node pool (leader and workers) and a one-pod one.
    "pod-options": {
        "images": {"pullSecrets": [{"name": "regcred"}]},
        "prefill": {
            "acceleratorResource": "amd.com/gpu",
            "runtimeClassName": "rocm",
            "priorityClassName": "inference-high",
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"tandem.dev/role": "prefill"}},
                            },
                        }
                    ]
                }
            },
            "podAnnotations": {"example.com/cost-center": "llm"},
            "podLabels": {"team": "llm"},
            "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}],
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            "initContainers": [
                {"name": "warm-cache", "image": "busybox:1.36", "command": ["sh", "-c", "true"]}
            ],
            "probes": {"startup": {"failureThreshold": 720}, "liveness": {"timeoutSeconds": 5}},
        },
        "decode": {
            "nodesPerReplica": 2,
            "gpusPerPod": 8,
            "parallelism": {"tensor": 8, "pipeline": 2},
            "acceleratorResource": "habana.ai/gaudi",
            "podLabels": {"team": "llm"},
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        },
    },
    "router-options": {
        "router": {
            "service": {
                "type": "LoadBalancer",
                "annotations": {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"},
            },
            "priorityClassName": "inference-high",
            "podAnnotations": {"example.com/cost-center": "llm"},
            "podLabels": {"team": "llm"},
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "node-role", "operator": "In", "values": ["cpu"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "probes": {"readiness": {"periodSeconds": 5}},
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "hosts": ["llm.example.com", "llm.internal.example.com"],
                "tlsSecretName": "llm-tls",
                "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "3600"},
            },
        }
    },
    "http-route": {
        "httpRoute": {
            "enabled": True,
            "parentRefs": [{"name": "inference-gateway", "namespace": "gateway"}],
            "hostnames": ["llm.example.com"],
            "annotations": {"example.com/owner": "llm"},
            "requestTimeoutSeconds": 3600,
        }
    },
    "http-route-inference-pool": {
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "inference-gateway"}]},
        "inferencePool": {"enabled": True, "endpointPicker": {"name": "tandem-epp"}},
    },
    "extra-objects": {
        "extraObjects": [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "{{ .Release.Name }}-notes", "namespace": "serving"},
                "data": {"model": "{{ .Values.model.path }}"},
            },
            "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: {{ .Release.Name }}-batch\n"
            "  namespace: {{ .Release.Namespace }}\n",
        ]
    },
    "extra-models": {
        "model": {"source": "hf://Qwen/Qwen3-8B", "cache": {"create": True}},
        "router": {"apiKeys": {"keys": ["sk-test-0001"]}},
        "autoscaling": {
            "decode": {
                "type": "keda",
                "triggers": [{"type": "cpu", "metadata": {"value": "80"}}],
            }
        },
        "extraModels": [
            {
                "name": "coder",
                "model": {"path": "Qwen/Qwen2.5-Coder-7B-Instruct", "servedName": "coder"},
                "decode": {"replicas": 2},
                "router": {"replicas": 1},
            },
            {
                "name": "embed",
                "model": {"source": "hf://BAAI/bge-m3"},
                "prefill": {"gpusPerPod": 0, "acceleratorResource": "amd.com/gpu"},
                "router": {"ingress": {"enabled": True, "host": "embed.example.com"}},
                "kvStore": {"enabled": False},
            },
        ],
    },
    "no-helm-test": {"helmTest": {"enabled": False}},
}


def all_cases() -> dict[str, dict]:
    """Case name → values: `default` (the chart's own), each example, each feature."""
    cases: dict[str, dict] = {"default": {}}
    cases.update({f"example-{name}": example(name) for name in EXAMPLE_NAMES})
    cases.update({f"feature-{name}": values for name, values in FEATURES.items()})
    return cases


CASES = all_cases()
