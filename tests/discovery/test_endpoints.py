"""The pure part of Kubernetes discovery: EndpointSlices to pods, and the
changes that bring the router's pod set in line with them."""

from __future__ import annotations

from common.kube import LABEL_POOL
from common.roles import Role
from services.router.discovery import merge_endpoints, plan_changes, slice_endpoints
from services.router.routing import PodSpec
from tests.discovery.slices import endpoint, endpoint_slice


def test_endpoints_carry_address_role_and_kv_event_endpoints():
    s = endpoint_slice(
        "demo-decode-x",
        "decode",
        50061,
        [
            endpoint("10.0.0.5", "demo-decode-0"),
            endpoint("10.0.0.6", "demo-decode-1", "terminating"),
            endpoint("10.0.0.7", "demo-decode-2", "unready"),
        ],
        kv_events_port=5557,
        kv_replay_port=5558,
    )
    eps = slice_endpoints(s)
    assert [e.spec for e in eps] == [
        PodSpec(
            f"10.0.0.{i}:50061", Role.DECODE, f"tcp://10.0.0.{i}:5557", f"tcp://10.0.0.{i}:5558"
        )
        for i in (5, 6, 7)
    ]
    assert [(e.ready, e.terminating, e.pod) for e in eps] == [
        (True, False, "demo-decode-0"),
        (False, True, "demo-decode-1"),
        (False, False, "demo-decode-2"),
    ]


def test_ipv6_addresses_are_bracketed_and_kv_events_optional():
    s = endpoint_slice("p", "prefill", 50061, [endpoint("fd00::1", "p-0")])
    s["addressType"] = "IPv6"
    [e] = slice_endpoints(s)
    assert e.spec == PodSpec("[fd00::1]:50061", Role.PREFILL, None, None)


def test_a_nil_ready_condition_means_ready():
    s = endpoint_slice("b", "both", 1, [{"addresses": ["10.0.0.1"], "conditions": {}}])
    assert slice_endpoints(s)[0].ready


def test_slices_without_grpc_port_role_or_addresses_name_no_engines():
    no_port = endpoint_slice("a", "decode", 1, [endpoint("10.0.0.1", "a")])
    no_port["ports"] = [{"name": "metrics", "port": 9061}]
    bad_role = endpoint_slice("b", "decoder", 1, [endpoint("10.0.0.1", "b")])
    no_address = endpoint_slice("c", "decode", 1, [{"addresses": [], "conditions": {}}])
    assert (
        slice_endpoints(no_port) == slice_endpoints(bad_role) == slice_endpoints(no_address) == []
    )


def test_a_pod_listed_twice_while_moving_between_slices_is_ready_if_either_says_so():
    old = endpoint_slice("a", "decode", 50061, [endpoint("10.0.0.1", "d-0", "unready")])
    new = endpoint_slice("b", "decode", 50061, [endpoint("10.0.0.1", "d-0")])
    assert merge_endpoints({"a": old, "b": new})["10.0.0.1:50061"].ready
    assert merge_endpoints({"b": new, "a": old})["10.0.0.1:50061"].ready


def test_plan_adds_ready_drains_terminating_and_removes_gone():
    s = endpoint_slice(
        "d",
        "decode",
        50061,
        [
            endpoint("10.0.0.1", "d-1"),  # new, ready: add
            endpoint("10.0.0.2", "d-2", "terminating"),  # in the pool: drain
            endpoint("10.0.0.3", "d-3", "terminating"),  # new but terminating: never added
            endpoint("10.0.0.4", "d-4"),  # drained before, ready again
            endpoint("10.0.0.5", "d-5", "unready"),  # in the pool, not ready: drain
            endpoint("10.0.0.6", "d-6"),  # in the pool, ready: nothing
            endpoint("10.0.0.8", "d-8", "terminating"),  # already drained: nothing
        ],
    )
    present = {
        "10.0.0.2:50061": False,
        "10.0.0.4:50061": True,
        "10.0.0.5:50061": False,
        "10.0.0.6:50061": False,
        "10.0.0.7:50061": True,
        "10.0.0.8:50061": True,
    }
    changes = plan_changes(present, merge_endpoints({"d": s}))
    assert [p.name for p in changes.add] == ["10.0.0.1:50061"]
    assert changes.drain == ["10.0.0.2:50061", "10.0.0.5:50061"]
    assert changes.undrain == ["10.0.0.4:50061"]
    assert changes.remove == ["10.0.0.7:50061"]


def test_plan_is_empty_when_the_pool_matches():
    s = endpoint_slice("d", "decode", 50061, [endpoint("10.0.0.1", "d-1")])
    assert not plan_changes({"10.0.0.1:50061": False}, merge_endpoints({"d": s}))
    assert not plan_changes({}, {})


def test_the_pool_label_names_the_pods_pool():
    s = endpoint_slice("demo-prefill-x", "prefill", 50061, [endpoint("10.0.0.5", "p-0")])
    s["metadata"]["labels"][LABEL_POOL] = "demo-prefill"
    [e] = slice_endpoints(s)
    assert e.spec == PodSpec("10.0.0.5:50061", Role.PREFILL, pool="demo-prefill")
