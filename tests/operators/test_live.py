"""The live loop's Kubernetes actuator and the planner's virtual one are the
same `Actuator` (operators/planner/actuator.py): the same async methods with
the same signatures, so the loop drives either without asking which."""

from __future__ import annotations

import inspect
import typing

import pytest

from operators.live import KubeActuator
from operators.planner.actuator import Actuator, VirtualActuator


@pytest.mark.parametrize("method", ["observe", "apply"])
def test_both_actuators_implement_the_protocol_alike(method):
    want = getattr(Actuator, method)
    for cls in (KubeActuator, VirtualActuator):
        got = getattr(cls, method)
        assert inspect.iscoroutinefunction(got), (cls, method)
        assert (
            inspect.signature(got).parameters.keys() == inspect.signature(want).parameters.keys()
        ), (cls, method)
        assert typing.get_type_hints(got) == typing.get_type_hints(want), (cls, method)
