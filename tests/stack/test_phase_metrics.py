"""Per-phase timing is visible in the engines' /metrics: one request through
the router on the P/D session stack shows up as one queue wait and one prefill
on the prefill engine and one KV pull and one first decode step on the decode
engine, each positive and together within what the client waited. Each engine
also publishes the scheduler settings it runs with. Real engines, no mocks."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import chat, engine

pytestmark = pytest.mark.stack

PHASES = {"prefill": ("queue", "prefill"), "decode": ("kv_pull", "first_decode_step")}


def _samples(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _phase(samples, role: str, phase: str, stat: str) -> float:
    key = (f"tandem_engine_{phase}_seconds_{stat}", frozenset({("role", role)}))
    return samples.get(key, 0.0)


def test_one_request_shows_in_every_phase_histogram(stack):
    urls = {role: engine(stack, role).url for role in PHASES}
    before = {role: _samples(url) for role, url in urls.items()}
    # Fresh tokens (a unique opening), long enough that the prefill takes real work.
    prompt = f"[{uuid.uuid4()}] " + " ".join(f"Line {i}: nothing to see." for i in range(60))
    t0 = time.monotonic()
    response = chat(stack.router_url, stack.model, prompt, max_tokens=2)
    waited = time.monotonic() - t0
    assert response.status_code == 200, response.text
    after = {role: _samples(url) for role, url in urls.items()}

    total = 0.0
    for role, phases in PHASES.items():
        for phase in phases:
            count = _phase(after[role], role, phase, "count") - _phase(
                before[role], role, phase, "count"
            )
            seconds = _phase(after[role], role, phase, "sum") - _phase(
                before[role], role, phase, "sum"
            )
            assert count == 1, f"{role} {phase}: {count} observations"
            assert seconds > 0, f"{role} {phase}: {seconds} s"
            total += seconds
    assert total < waited, f"phases add up to {total:.3f} s, the client waited {waited:.3f} s"


def test_engines_publish_their_scheduler_settings(stack):
    for role in PHASES:
        info = [
            dict(labels)
            for (name, labels), value in _samples(engine(stack, role).url).items()
            if name == "tandem_engine_scheduler_info" and value == 1
        ]
        assert info == [
            {
                "role": role,
                "long_prefill_token_threshold": "0",
                "long_prefill_token_threshold_adaptive": "false",
                "max_num_batched_tokens": "2048",
                "max_num_seqs": "128",
                "enable_chunked_prefill": "true",
            }
        ]
