"""Profile documents: round trips, ConfigMaps, errors that name the field."""

from __future__ import annotations

import json

import pytest

from operators.planner.profiles import (
    PROFILE_KEY,
    PROFILE_LABEL,
    ProfileError,
    profile_configmap,
    profile_from_configmap,
    profile_from_dict,
    profile_to_dict,
)
from tests.planner.synthetic import ramp_profile


def test_round_trip_through_a_configmap():
    profile = ramp_profile("decode-h100-tp2", "decode", 65.0, gpus=2, kv_capacity_tokens=900_000)
    cm = profile_configmap(profile, "smollm2-decode", namespace="serving")
    assert cm["kind"] == "ConfigMap"
    assert cm["metadata"]["labels"][PROFILE_LABEL] == "decode"
    assert cm["metadata"]["labels"]["tandem.dev/profile-source"] == "published"
    doc = json.loads(cm["data"][PROFILE_KEY])
    assert doc["config"]["gpusPerReplica"] == 2
    assert doc["points"][0]["ttftP90S"] == pytest.approx(0.2)
    assert profile_from_configmap(cm) == profile


def bad(mutate) -> str:
    doc = profile_to_dict(ramp_profile("p", "prefill", 10.0))
    mutate(doc)
    with pytest.raises(ProfileError) as err:
        profile_from_dict(doc)
    return str(err.value)


def test_errors_name_the_field():
    assert "config.role 'both'" in bad(lambda d: d["config"].update(role="both"))
    assert "points[2]: concurrency must rise" in bad(
        lambda d: d["points"][2].update(concurrency=1.0)
    )
    assert "points[0].requestRate must be a number" in bad(
        lambda d: d["points"][0].update(requestRate="fast")
    )
    assert "points[1]: hitRate must be in [0, 1)" in bad(
        lambda d: d["points"][1].update(hitRate=1.0)
    )
    assert "dcp (3) must divide tp (1)" in bad(lambda d: d["config"]["parallelism"].update(dcp=3))
    assert "source 'guessed'" in bad(lambda d: d.update(source="guessed"))
    assert "version 7 is not supported" in bad(lambda d: d.update(version=7))
    assert "ttftP90S is below ttftP50S" in bad(lambda d: d["points"][0].update(ttftP90S=0.01))
    assert "inFlight is required in a measured profile" in bad(
        lambda d: (d.update(source="measured"), d["points"][0].update(inFlight=None))
    )


def test_configmap_errors_name_the_configmap():
    cm = profile_configmap(ramp_profile("p", "prefill", 10.0), "pre")
    cm["data"][PROFILE_KEY] = "{not json"
    with pytest.raises(ProfileError, match="ConfigMap pre: data.profile.json is not JSON"):
        profile_from_configmap(cm)
    del cm["data"][PROFILE_KEY]
    with pytest.raises(ProfileError, match="ConfigMap pre: data.profile.json is missing"):
        profile_from_configmap(cm)
