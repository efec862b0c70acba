"""The operator's settings are one object built from its flags and handed to
the handlers: nothing is read from the environment or registered at import."""

from __future__ import annotations

import kopf

from common.settings import from_arguments
from operators import handlers
from operators.__main__ import build_parser
from operators.settings import OperatorSettings


def settings(argv: list[str]) -> OperatorSettings:
    parsed: OperatorSettings = from_arguments(OperatorSettings, build_parser().parse_args(argv))
    return parsed


def test_the_flags_build_the_settings():
    s = settings(
        [
            "--resync-seconds",
            "5",
            "-n",
            "team-*",
            "--namespace",
            "prod",
            "--kubeconfig",
            "/k",
            "--metrics-port",
            "0",
        ]
    )
    assert (s.resync_seconds, s.namespaces, s.kubeconfig, s.metrics_port) == (
        5.0,
        ["team-*", "prod"],
        "/k",
        0,
    )
    assert settings([]).scaling_seconds == 15.0 and settings([]).namespaces == []


def test_the_handlers_take_their_intervals_from_the_settings_not_the_import():
    assert handlers  # imported: it must have put nothing in kopf's default registry
    default = kopf.get_default_registry()
    assert not any(default._spawning.get_all_handlers())
    registry = handlers.register(OperatorSettings(resync_seconds=7.0, scaling_seconds=3.0))
    # kopf's registry has no public listing. No timer or daemon (spawning handlers)
    # and no mandatory delete handler: kopf would put a finalizer on every deployment.
    assert not any(registry._spawning.get_all_handlers())
    assert not any(h.requires_finalizer for h in registry._changing.get_all_handlers())
    indexes = {h.id for h in registry._indexing.get_all_handlers()}
    assert indexes == {"deployments_by_namespace", "hpas_by_namespace", "profiles_by_namespace"}
