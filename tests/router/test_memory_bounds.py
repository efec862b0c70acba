"""Every router table that grows with traffic stops at its bound: the memory
the tables hold, measured with tracemalloc while distinct blocks, sessions
and stored responses go through the router's public seams (in process, no
engines, no mocks; the model's real tokenizer). A smaller scale than
``make soak-memory`` (bench/memory_bounds.py), still well past each bound.
Also: the bounds' flags, their metrics, and the endpoint label that no
longer takes each raw path."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import generate_latest
from transformers import AutoTokenizer

from bench.memory_bounds import (
    Point,
    drive_blocks,
    drive_responses,
    drive_sessions,
    flat_after_bound,
    table,
)
from common.model import resolve_model
from services.router.api.responses.serving import ResponseStore
from services.router.app import bounded_tables, create_app
from services.router.config import RouterSettings, parse_settings
from services.router.metrics import RouterMetrics
from services.router.retention import RetentionSettings, SessionRetention
from services.router.routing import RoutingCore, RoutingSettings
from services.router.routing.shared_state import LocalState


def _check(points: list[Point], bounds: dict[str, int]) -> None:
    print("\n" + table(points))
    assert flat_after_bound(points) is None, flat_after_bound(points)
    assert points[-1].entries == bounds


def test_index_memory_flattens_at_its_bound():
    points = drive_blocks([2_000, 16_000, 32_000], bound=8_000)
    _check(points, {"prefix_index": 8_000, "predicted_index": 4_000})


def test_session_tables_memory_flattens_at_their_bounds():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    points = drive_sessions([200, 2_000, 4_000], bound=600, tokenizer=tokenizer)
    # The prefix index holds no session's blocks: no engine confirmed them.
    names = (
        "session_bindings",
        "live_sessions",
        "hash_chains",
        "tokenizer_sessions",
        "retention_sessions",
    )
    _check(points, {**dict.fromkeys(names, 600), "prefix_index": 0})


def test_response_store_memory_flattens_at_its_bound():
    points = drive_responses([300, 3_000, 6_000], bound=1_000)
    _check(points, {"stored_responses": 1_000})


def test_growth_past_the_bound_is_caught():
    def point(driven: int, traced: int) -> Point:
        return Point("t", driven, {}, traced, 0.0)

    assert flat_after_bound([point(1, 10), point(2, 100), point(3, 104)]) is None
    assert "grew 10.0%" in flat_after_bound([point(1, 10), point(2, 100), point(3, 110)])
    assert "did not grow" in flat_after_bound([point(1, 100), point(2, 100), point(3, 100)])
    assert "three checkpoints" in flat_after_bound([point(1, 10), point(2, 100)])


@pytest.mark.parametrize(
    "flag",
    [
        "--routing-index-capacity",
        "--routing-predicted-capacity",
        "--max-session-bindings",
        "--session-binding-ttl-s",
        "--live-max-sessions",
        "--live-max-blocks",
        "--live-max-tokens",
        "--kv-retention-max-sessions",
        "--kv-retention-max-blocks",
        "--tokenizer-cache-sessions",
        "--tokenizer-cache-tokens",
        "--responses-store-max",
        "--responses-store-max-chars",
    ],
)
def test_each_bound_is_a_flag_that_refuses_zero(flag, capsys):
    settings = parse_settings(["--engine", "e:1", flag, "7"])
    assert "7" in repr(settings)
    with pytest.raises(SystemExit):
        parse_settings(["--engine", "e:1", flag, "0"])
    assert flag in capsys.readouterr().err


def test_tables_are_exposed_with_their_evictions():
    core = RoutingCore(RoutingSettings(index_capacity=2))
    core.index.stored("p", [1, 2, 3])
    state = LocalState(max_sessions=5)
    retention = SessionRetention(RetentionSettings(), block_size=16)
    store = ResponseStore()

    class SlowTokenizer:
        session_cache = None  # a slow tokenizer has no session cache

    metrics = RouterMetrics()
    metrics.watch_tables(
        lambda: bounded_tables(core, state, retention, SlowTokenizer(), store, None)
    )
    text = generate_latest(metrics.registry).decode()
    assert 'tandem_router_table_entries{table="prefix_index"} 2.0' in text
    assert 'tandem_router_table_evictions_total{table="prefix_index"} 1.0' in text
    assert 'tandem_router_table_capacity{table="prefix_index"} 2.0' in text
    for table_name in (
        "predicted_index",
        "live_sessions",
        "hash_chains",
        "session_bindings",
        "retention_sessions",
        "stored_responses",
    ):
        assert f'tandem_router_table_entries{{table="{table_name}"}} 0.0' in text


async def test_request_metrics_are_labelled_by_route_not_by_path():
    app = create_app(RouterSettings(engines=["fake:1"], api_keys=("k",)))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as router:
        auth = {"authorization": "Bearer k"}
        for i in range(3):
            await router.get(f"/v1/responses/resp_{i}", headers=auth)  # 503: not started
            await router.get(f"/no/such/path/{i}", headers=auth)
        await router.get("/v1/responses/resp_x")  # 401 before routing: still the route
        metrics = (await router.get("/metrics")).text
    assert 'endpoint="/v1/responses/{response_id}",status="503"} 3.0' in metrics
    assert 'endpoint="/v1/responses/{response_id}",status="401"} 1.0' in metrics
    assert 'endpoint="unmatched",status="404"} 3.0' in metrics
    assert "resp_0" not in metrics and "/no/such" not in metrics
