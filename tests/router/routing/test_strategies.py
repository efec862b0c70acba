"""The policy registry is the one list of routing policies: the router's flag,
the operator's CRD and the Helm chart's values schema all say what it says.
Reads the real files; no mocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from services.router.config import build_parser, parse_settings
from services.router.routing.policy import PodView, Policy, PolicySettings, RouteInput
from services.router.routing.strategies import POLICIES, PUBLIC_POLICIES, REGISTRY

ROOT = Path(__file__).resolve().parents[3]
CRD = ROOT / "operators" / "crds" / "tandemdeployments.yaml"
CHART = ROOT / "helm" / "tandem"


def crd_router_policy() -> dict:
    doc = yaml.safe_load(CRD.read_text())
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["spec"]["properties"]["router"]["properties"]["policy"]


def test_each_policy_is_registered_once_under_its_own_name():
    assert tuple(REGISTRY) == POLICIES
    assert POLICIES == ("cost", "round-robin", "least-load", "prefix", "session", "consistent-hash")
    for name, cls in REGISTRY.items():
        assert cls.name == name
        assert Policy(PolicySettings(policy=name)).strategy.name == name


def test_the_default_policy_is_registered_and_public():
    assert PolicySettings().policy in PUBLIC_POLICIES


def test_the_router_flag_offers_every_registered_policy():
    for name in POLICIES:
        assert (
            parse_settings(["--engine", "e:1", "--routing-policy", name]).routing.policy.policy
            == name
        )
    with pytest.raises(SystemExit):
        parse_settings(["--engine", "e:1", "--routing-policy", "fastest"])
    help_text = " ".join(build_parser().format_help().split())
    assert "{" + ",".join(POLICIES) + "}" in help_text
    for name, cls in REGISTRY.items():
        assert (f"{name} ({cls.summary})" if cls.summary else name) in help_text


def test_the_crd_offers_the_public_policies_with_the_routers_default():
    policy = crd_router_policy()
    assert policy["enum"] == list(PUBLIC_POLICIES), (
        f"{CRD.relative_to(ROOT)}: router.policy's enum must be the registry's public "
        f"policies: enum: [{', '.join(PUBLIC_POLICIES)}]"
    )
    assert policy["default"] == PolicySettings().policy


def test_the_chart_offers_the_public_policies_with_the_routers_default():
    schema = json.loads((CHART / "values.schema.json").read_text())
    policy = schema["properties"]["router"]["properties"]["policy"]
    assert policy["enum"] == list(PUBLIC_POLICIES), (
        "helm/tandem/values.schema.json: router.policy's enum must be the registry's "
        f"public policies: {json.dumps(list(PUBLIC_POLICIES))}"
    )
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["router"]["policy"] == PolicySettings().policy


@pytest.mark.parametrize("name", POLICIES)
def test_every_strategy_answers_for_decode_and_prefill_pods(name):
    # Two prefill pods and two decode pods, nothing cached and a long prompt:
    # the P/D path asks the strategy for both pods.
    views = [
        PodView("p1", role="prefill"),
        PodView("p2", role="prefill"),
        PodView("d1", role="decode"),
        PodView("d2", role="decode"),
    ]
    c = Policy(PolicySettings(policy=name)).choose(RouteInput(4000, views, "s"))
    assert c.pod in ("d1", "d2") and c.prefill_pod in ("p1", "p2")
    assert c.local_prefill is None and "+prefill-" in c.reason


def test_peek_leaves_the_round_robin_cursor_where_it_was():
    views = [PodView("a"), PodView("b"), PodView("c")]
    policy = Policy(PolicySettings(policy="round-robin"))
    assert policy.choose(RouteInput(10, views)).pod == "a"
    assert [policy.peek(RouteInput(10, views)).pod for _ in range(3)] == ["b", "b", "b"]
    assert [policy.choose(RouteInput(10, views)).pod for _ in range(3)] == ["b", "c", "a"]
