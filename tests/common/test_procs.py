"""Stopping services: peers get SIGTERM together, a service that ignores it
is killed with its whole process group after the grace period."""

from __future__ import annotations

import time

from common.procs import ORPHAN_GRACE_S, Proc, group_alive, launch, stop_process_groups
from services.stack import stop_tiers

# On SIGTERM: note it, take a second to "drain", note the exit.
DRAINS = (
    'trap \'echo term >> "$0"; sleep 1; echo exit >> "$0"; exit 0\' TERM; '
    "while true; do sleep 0.05; done"
)


def test_peers_drain_side_by_side(tmp_path):
    events = tmp_path / "events"
    started = [
        launch(f"engine-{i}", ["bash", "-c", DRAINS, str(events)], tmp_path / f"{i}.log")
        for i in range(2)
    ]
    time.sleep(0.3)  # both have set their trap
    stop_process_groups([proc for proc, _ in started], grace_s=10)
    for _, popen in started:
        popen.wait(timeout=5)
    # One after the other would read term, exit, term, exit.
    assert events.read_text().split() == ["term", "term", "exit", "exit"]


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    # The child ignores SIGTERM too and would outlive its parent.
    proc, popen = launch(
        "stubborn", ["bash", "-c", "trap '' TERM; sleep 600 & wait"], tmp_path / "log"
    )
    time.sleep(0.3)
    stop_process_groups([proc], grace_s=0.5)
    popen.wait(timeout=5)
    deadline = time.monotonic() + 5
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_alive(proc.pid)


def test_leftovers_of_a_group_whose_service_exited_are_killed_soon(tmp_path):
    # The service exits at once on SIGTERM; its child ignores SIGTERM and
    # would keep the group alive for the whole grace period.
    proc, popen = launch(
        "leaves-a-child", ["bash", "-c", "(trap '' TERM; sleep 600) & wait"], tmp_path / "log"
    )
    time.sleep(0.3)
    t0 = time.monotonic()
    stop_process_groups([proc], grace_s=30)
    assert time.monotonic() - t0 < ORPHAN_GRACE_S + 2
    popen.wait(timeout=5)
    assert not group_alive(proc.pid)


def test_a_stack_stops_router_then_engines_together_then_store():
    procs = [
        Proc(name=n, argv=[], log="")
        for n in ("kvstore", "prefill-0", "router", "decode-0", "decode-1")
    ]
    assert [[p.name for p in tier] for tier in stop_tiers(procs)] == [
        ["router"],
        ["prefill-0", "decode-0", "decode-1"],
        ["kvstore"],
    ]


def test_nothing_to_stop_returns_at_once():
    t0 = time.monotonic()
    stop_process_groups([Proc(name="never-started", argv=[], log="")], grace_s=30)
    assert time.monotonic() - t0 < 1
