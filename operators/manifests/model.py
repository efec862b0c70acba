"""The model download Job (pure): an hf:// `model.source` is fetched once into
the cache claim before any engine starts.

The operator, not the chart, runs it: it alone knows when engines may start
(it creates their workloads only once the Job completed) and reports the
download in the TandemDeployment's `ModelReady` condition; a chart hook
would block `helm install` and could not hold back the operator's engines.
The Job is named after the source and the Hub endpoint, so a new revision
or mirror is a new Job (a Job's pod template cannot change), and engines keep
the old weights until it completes.
"""

from __future__ import annotations

import hashlib
from typing import Any

from common.model_source import HF, MOUNT
from operators.manifests.meta import Manifest, Owner, labels, meta, pull_secrets
from operators.spec import TandemSpec

# The download is network- and disk-bound: a little CPU, memory for hashing.
DOWNLOAD_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}


def download_job_name(td: str, source: str, hub_endpoint: str | None = None) -> str:
    """Named after what it downloads from where: a new revision or Hub
    endpoint is a new Job (a Job's pod template cannot change)."""
    origin = source if hub_endpoint is None else f"{source} from {hub_endpoint}"
    return f"{td}-model-{hashlib.sha256(origin.encode()).hexdigest()[:8]}"


def model_download_job(td: str, namespace: str, spec: TandemSpec, owner: Owner) -> Manifest | None:
    """The Job that fills the cache claim, or None when nothing is downloaded."""
    model = spec.model
    if model.source is None or model.origin.kind != HF or model.cache is None:
        return None
    lbls = labels(td, "model-download")
    env: list[dict[str, Any]] = [{"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if model.hub_endpoint is not None:
        # huggingface_hub reads it for every call: the mirror an air-gapped
        # cluster serves the Hub's API and files from.
        env.append({"name": "HF_ENDPOINT", "value": model.hub_endpoint})
    ref = model.hf_token_secret_ref
    if ref is not None:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    container = {
        "name": "download",
        "image": spec.images.engine,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["python", "-m", "common.model_source", model.source],
        "env": env,
        "resources": DOWNLOAD_RESOURCES,
        "volumeMounts": [{"name": "model", "mountPath": MOUNT}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta(
            download_job_name(td, model.source, model.hub_endpoint), namespace, owner, lbls
        ),
        "spec": {
            "backoffLimit": model.download_backoff_limit,
            "template": {
                "metadata": {"labels": lbls},
                "spec": {
                    "restartPolicy": "Never",
                    **pull_secrets(spec),
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "model",
                            "persistentVolumeClaim": {
                                "claimName": model.cache.persistent_volume_claim
                            },
                        }
                    ],
                },
            },
        },
    }
