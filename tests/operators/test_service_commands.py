"""Every command a launcher renders parses with the service's own parser: the
router's and the engine host's argparse parsers (built as their `main`
builds them: a flag they do not know exits) and the Mooncake binaries' flag
lists (`--helpfull`). Launchers: the operator (router, each engine role, the
LeaderWorkerSet leader's Ray script, the store master and clients) and the
embedded stack (`services/stack.py`). No mocks: the real parsers, the real
binaries."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from common.grpc_health import ProbeSettings
from common.mooncake import find_binary
from common.procs import Proc
from common.roles import Role
from common.settings import add_arguments, from_arguments
from operators import manifests
from operators.spec import ENGINE_ROLE, parse, with_defaults
from services.stack import Stack, StackConfig

OWNER = manifests.Owner("TandemDeployment", "demo", "uid-td")

SPECS = {
    "pd": {
        "model": {"path": "/models/llama", "servedName": "llama", "maxModelLen": 32768},
        "prefill": {
            "replicas": 2,
            "parallelism": {"tensor": 2},
            "gpusPerPod": 2,
            "engineArgs": ["--long-prefill-token-threshold=2048"],
        },
        "decode": {"replicas": 4, "parallelism": {"expert": True, "data": 2}},
        "router": {"replicas": 3, "policy": "round-robin"},
    },
    "mtls": {
        "model": {"path": "/m"},
        "prefill": {},
        "decode": {"nodesPerReplica": 2, "parallelism": {"tensor": 2}},
        "grpcTls": {"secretName": "demo-grpc-tls", "serverName": "demo-engine"},
    },
    "lws": {
        "model": {"path": "/m", "dtype": "bfloat16"},
        "decode": {
            "nodesPerReplica": 2,
            "gpusPerPod": 8,
            "parallelism": {"tensor": 8, "pipeline": 2},
        },
        "aggregated": {
            "nodesPerReplica": 2,
            "gpusPerPod": 1,
            "parallelism": {"pipeline": 2, "prefillContext": 2},
        },
        "kvStore": {"enabled": False},
        "redis": {"managed": False, "url": "redis://r:6379"},
    },
}


def router_parse(argv: list[str]):
    from services.router.config import build_parser

    assert argv[1:3] == ["-m", "services.router"]
    return build_parser().parse_args(argv[3:])


def engine_parse(argv: list[str]):
    """As `services.<module>`'s main parses it (without the runtime checks
    that need a model or a store)."""
    from services.engine.config import build_parser

    default_role = {
        "services.prefill": Role.PREFILL,
        "services.decode": Role.DECODE,
        "services.engine": None,
    }[argv[2]]
    return build_parser(default_role).parse_args(argv[3:])


def containers(obj: dict) -> list[dict]:
    spec = obj["spec"]
    if "leaderWorkerTemplate" in spec:
        group = spec["leaderWorkerTemplate"]
        return [
            *group["leaderTemplate"]["spec"]["containers"],
            *group["workerTemplate"]["spec"]["containers"],
        ]
    return spec["template"]["spec"]["containers"]


def rendered(name: str) -> tuple[dict, list[dict]]:
    spec = with_defaults(SPECS[name])
    objs = manifests.shared_objects("demo", "prod", parse(spec), OWNER)
    for role in parse(spec).roles:
        objs += manifests.pool_workload("demo", "prod", parse(spec), role, 1, OWNER)
    return spec, objs


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_operators_router_command_parses(name):
    spec, objs = rendered(name)
    [router] = [
        o for o in objs if o["metadata"]["name"] == "demo-router" and o["kind"] == "Deployment"
    ]
    [container] = containers(router)
    args = router_parse(container["command"] + container["args"])
    assert args.discovery == "kubernetes" and args.discovery_deployment == "demo"
    assert args.routing_policy == spec["router"]["policy"]
    assert args.grpc_tls_server_name == spec.get("grpcTls", {}).get("serverName")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_engine_command_the_operator_renders_parses(name):
    spec, objs = rendered(name)
    seen = set()
    for role in parse(spec).roles:
        [workload] = [
            o
            for o in objs
            if o["metadata"]["name"] == f"demo-{role}"
            and o["kind"] in ("Deployment", "LeaderWorkerSet")
        ]
        engine = containers(workload)[0]
        if engine["command"] == ["sh", "-c"]:  # a LeaderWorkerSet leader: Ray, then exec
            argv = shlex.split(engine["args"][0].rpartition("&& exec ")[2])
            seen.add("ray")
        else:
            argv = engine["command"] + engine["args"]
        args = engine_parse(argv)
        assert args.role == ENGINE_ROLE[role]
        assert (args.grpc_tls_cert is not None) == ("grpcTls" in spec)
        assert args.tensor_parallel_size == spec[role]["parallelism"]["tensor"]
        assert args.distributed_executor_backend == (
            "ray" if argv != engine["command"] + engine["args"] else None
        )
        seen.add(role)
    assert seen >= set(parse(spec).roles)


def test_the_engines_mtls_probe_parses_and_names_what_the_router_checks():
    """Under mTLS the kubelet's plaintext gRPC probe is refused: the engines'
    readiness and startup probes run common.grpc_health with the router's flags."""
    spec, objs = rendered("mtls")
    probed = 0
    for obj in objs:
        if obj["kind"] not in ("Deployment", "LeaderWorkerSet"):
            continue
        for c in containers(obj):
            if c["name"] != "engine":
                continue
            for probe in ("readinessProbe", "startupProbe"):
                sh, flag, script = c[probe]["exec"]["command"]
                argv = shlex.split(script.replace("$POD_IP", "10.0.0.7"))
                assert (sh, flag, argv[:3]) == ("sh", "-c", ["python", "-m", "common.grpc_health"])
                parser = argparse.ArgumentParser()
                add_arguments(parser, ProbeSettings, "")
                settings = from_arguments(ProbeSettings, parser.parse_args(argv[3:]))
                assert settings.address == f"10.0.0.7:{manifests.GRPC_PORT}"
                assert settings.tls.grpc_tls_server_name == spec["grpcTls"]["serverName"]
                assert settings.tls.grpc_tls_cert == "/etc/tandem/grpc-tls/tls.crt"
                probed += 1
    assert probed == 4  # prefill's and decode's leader, two probes each


def mooncake_flags(binary: str) -> set[str]:
    out = subprocess.run(
        [find_binary(binary), "--helpfull"], capture_output=True, text=True, timeout=30
    )
    return set(re.findall(r"^\s+-(\w+) ", out.stdout + out.stderr, re.M))


def test_the_store_master_and_client_commands_name_only_flags_the_binaries_know():
    _, objs = rendered("pd")
    commands = {
        o["metadata"]["name"]: containers(o)[0]
        for o in objs
        if o["kind"] in ("Deployment", "DaemonSet") and "kvstore" in o["metadata"]["name"]
    }
    for name, binary in (
        ("demo-kvstore-master", "mooncake_master"),
        ("demo-kvstore-client", "mooncake_client"),
    ):
        known = mooncake_flags(binary)
        assert len(known) > 20  # the flag list was read
        container = commands[name]
        assert container["command"][0].endswith(binary)
        flags = [a.removeprefix("--").partition("=")[0] for a in container["args"]]
        assert flags and [f for f in flags if f not in known] == []


def test_an_unknown_flag_fails_each_parser():
    with pytest.raises(SystemExit):
        router_parse(["python", "-m", "services.router", "--no-such-flag=1"])
    with pytest.raises(SystemExit):
        engine_parse(["python", "-m", "services.decode", "--no-such-flag=1"])
    assert "no_such_flag" not in mooncake_flags("mooncake_master")


def test_every_command_the_stack_builds_parses(tmp_path: Path):
    config = StackConfig(
        model="/models/llama",
        prefill=1,
        decode=1,
        aggregated=1,
        ports_from=20000,
        state_dir=tmp_path,
        engine_args=["--block-size=16"],
    )
    stack = Stack(config)
    launched: list[Proc] = []
    for role in ("prefill", "decode", "engine"):
        proc, _ = stack.engine_proc(role, 0, None, ["--kv-store-config", "/s/m.json"])
        args = engine_parse(proc.argv)
        assert args.role == {"prefill": "prefill", "decode": "decode", "engine": "both"}[role]
        assert args.kv_store_config == "/s/m.json" and args.block_size == 16
        assert args.kv_events_config is not None and args.enforce_eager
        launched.append(proc)
    stack.procs = launched
    args = router_parse(stack.router_argv(8000, ["--policy", "prefix"]))
    assert (args.prefill, args.decode, args.engine) == (
        [launched[0].grpc],
        [launched[1].grpc],
        [launched[2].grpc],
    )
    assert [s.pod for s in args.kv_events] == [p.grpc for p in launched]
    assert args.model == "/models/llama" and args.port == 8000
