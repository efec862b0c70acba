"""ModelReady from the download Job's status (operators/status.py, pure), and
the model sources the CRD accepts (common/model_source.py)."""

from __future__ import annotations

import pytest

from common.model_source import HF, LOCAL, PATTERN, PVC, main, parse_source
from operators.spec import crd_schema
from operators.status import Condition, deployment_conditions, model_condition

SOURCE = "hf://Qwen/Qwen3-8B@main"


def job(**status) -> dict:
    return {"metadata": {"name": "demo-model-1"}, "spec": {"backoffLimit": 3}, "status": status}


def test_model_ready_follows_the_job():
    assert model_condition(SOURCE, None).reason == "Downloading"
    running = model_condition(SOURCE, job(active=1, failed=2))
    assert (running.status, running.reason) == (False, "Downloading")
    assert "2 of 4 tries failed" in running.message
    done = model_condition(SOURCE, job(conditions=[{"type": "Complete", "status": "True"}]))
    assert (done.status, done.reason) == (True, "Downloaded")
    failed = model_condition(
        SOURCE,
        job(conditions=[{"type": "Failed", "status": "True", "message": "BackoffLimitExceeded"}]),
    )
    assert (failed.status, failed.reason) == (False, "DownloadFailed")
    assert (
        "BackoffLimitExceeded" in failed.message
        and "kubectl logs job/demo-model-1" in failed.message
    )


def test_a_failed_download_degrades_the_deployment_and_a_running_one_waits():
    failed = Condition("ModelReady", False, "DownloadFailed", "job/x failed")
    by_type = {c.type: c for c in deployment_conditions([], False, [], [], failed)}
    assert (by_type["Degraded"].status, by_type["Degraded"].reason) == (True, "DownloadFailed")
    assert not by_type["Ready"].status and by_type["ModelReady"] == failed
    running = Condition("ModelReady", False, "Downloading", "")
    by_type = {c.type: c for c in deployment_conditions([], True, [], [], running)}
    assert not by_type["Ready"].status and not by_type["Degraded"].status
    assert "the model download" in by_type["Progressing"].message
    # No download: no ModelReady at all.
    assert "ModelReady" not in {c.type for c in deployment_conditions([], True, [], [])}


@pytest.mark.parametrize(
    "text,kind,path",
    [
        ("hf://Qwen/Qwen3-8B@9c1d2a7", HF, "/models/hf/Qwen/Qwen3-8B/9c1d2a7"),
        ("hf://meta-llama/Llama-3.1-8B", HF, "/models/hf/meta-llama/Llama-3.1-8B/main"),
        ("pvc://weights/llama", PVC, "/models/llama"),
        ("pvc://weights", PVC, "/models"),
        ("/opt/models/smol", LOCAL, "/opt/models/smol"),
    ],
)
def test_sources_parse_where_the_crd_accepts_them(text, kind, path):
    import re

    source = parse_source(text)
    assert (source.kind, source.model_path) == (kind, path)
    assert re.match(PATTERN, text)
    crd = crd_schema("tandemdeployments")["properties"]["spec"]["properties"]["model"]
    assert crd["properties"]["source"]["pattern"] == PATTERN


@pytest.mark.parametrize("text", ["s3://bucket/m", "hf://Qwen", "pvc://Weights/m", "models/m"])
def test_other_sources_are_refused_by_both(text):
    import re

    with pytest.raises(ValueError, match="expected hf://"):
        parse_source(text)
    assert not re.match(PATTERN, text)
    assert main([text]) == 2
