"""The router's command line, for every launcher: the embedded stack
(``services/stack.py``) and the Kubernetes operator render it from these
objects, and the router parses it (``services/router/config.py``, whose
``RouterSettings`` extends :class:`RouterLaunchSettings`).

Each setting is declared once here with its default and help; its flag and
its ``TANDEM_ROUTER_<FLAG>`` variable derive from it (``common/settings.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from common.settings import SettingError, flag_of, setting, to_argv


@dataclass(frozen=True)
class KvEventSource:
    pod: str  # the pod's gRPC address, as the router names pods
    endpoint: str  # PUB endpoint, e.g. tcp://127.0.0.1:5701
    replay_endpoint: str | None = None  # ROUTER endpoint, e.g. tcp://127.0.0.1:5702

    def __str__(self) -> str:  # the flag's own syntax (to_argv renders it)
        return f"{self.pod}={self.endpoint}" + (
            f",{self.replay_endpoint}" if self.replay_endpoint else ""
        )


def parse_kv_event_source(text: str) -> KvEventSource:
    """``POD=PUB_ENDPOINT[,REPLAY_ENDPOINT]``."""
    pod, sep, rest = text.partition("=")
    if not sep or not pod or not rest:
        raise argparse.ArgumentTypeError(
            f"--kv-events {text!r}: expected POD=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]"
        )
    endpoint, _, replay = rest.partition(",")
    return KvEventSource(pod.strip(), endpoint.strip(), replay.strip() or None)


@dataclass(frozen=True)
class RouterLaunchSettings:
    """Where the router listens, which engines it fronts and which model it serves."""

    host: str = setting("127.0.0.1", "HTTP listen address")
    port: int = setting(8000, "HTTP port")
    prefill: list[str] = setting(
        [],
        "prefill pod gRPC address (repeat or comma-separate); "
        "POOL=ADDR names the pod's pool (--prefill-pool-for)",
        metavar="[POOL=]ADDR",
    )
    decode: list[str] = setting(
        [], "decode pod gRPC address (repeat or comma-separate)", metavar="[POOL=]ADDR"
    )
    engines: list[str] = setting(
        [],
        "aggregated engine (role both) gRPC address; serves whole requests without a P/D split",
        flag="--engine",
        metavar="[POOL=]ADDR",
    )
    kv_events: tuple[KvEventSource, ...] = setting(
        (),
        "subscribe to a pod's vLLM KV events (repeat per pod); pods without events get "
        "predicted index entries",
        parse=parse_kv_event_source,
        metavar="POD=PUB[,REPLAY]",
        env=False,
    )
    model: str | None = setting(
        None, "model folder for the tokenizer and chat template (default: the engines' model path)"
    )
    served_model_name: str | None = setting(
        None, "model name clients send (default: the engines' name)"
    )
    max_migrations: int = setting(
        2,
        "how often a request whose decode pod is lost mid-stream may resume on another "
        "pod from its prompt plus the tokens already sent, in the same stream (0: never; "
        "the stream then ends in an error event)",
        metavar="N",
    )


@dataclass(frozen=True)
class RateLimitSettings:
    """Per-client rate limits (services/router/rate_limits.py): a client is an
    API key when keys are configured, else the connection's peer address."""

    rate_limit_requests_per_s: float = setting(
        0.0,
        "requests per second each client may send, /health and /metrics aside (0: no limit)",
        metavar="RATE",
    )
    rate_limit_burst: int = setting(
        0,
        "requests a client may send at once above that rate (0: one second's worth, at least 1)",
        metavar="N",
    )
    rate_limit_tokens_per_min: int = setting(
        0,
        "prompt plus completion tokens per minute each client may use on the generation "
        "endpoints (0: no limit); a client in debt gets 429 until it is paid back",
        metavar="TOKENS",
    )
    rate_limit_max_clients: int = setting(
        100_000,
        "clients whose buckets are kept (least recently seen forgotten beyond: it starts "
        "again with a full bucket)",
        metavar="N",
    )

    @property
    def enabled(self) -> bool:
        return self.rate_limit_requests_per_s > 0 or self.rate_limit_tokens_per_min > 0

    def validate(self) -> None:
        for name in ("rate_limit_requests_per_s", "rate_limit_burst", "rate_limit_tokens_per_min"):
            if getattr(self, name) < 0:
                raise SettingError(flag_of(RateLimitSettings, name), "cannot be negative")
        if self.rate_limit_max_clients <= 0:
            raise SettingError(
                flag_of(RateLimitSettings, "rate_limit_max_clients"), "must be positive"
            )


DISCOVERY_MODES = ("static", "kubernetes")


@dataclass(frozen=True)
class DiscoverySettings:
    discovery: str = setting(
        "static",
        "where the engine pods come from: static (the --prefill, --decode and "
        "--engine flags, fixed) or kubernetes (the EndpointSlices of a TandemDeployment's "
        "engine pools, followed as pods become ready, terminate and go)",
        choices=DISCOVERY_MODES,
    )
    discovery_namespace: str | None = setting(
        None,
        "--discovery kubernetes: namespace of the TandemDeployment (default: the "
        "router pod's own namespace)",
        metavar="NAMESPACE",
    )
    discovery_deployment: str | None = setting(
        None,
        "--discovery kubernetes: the TandemDeployment whose engine pools to follow "
        "(EndpointSlices labelled tandem.dev/deployment=NAME, "
        "app.kubernetes.io/component=engine; the role from tandem.dev/role)",
        metavar="NAME",
    )
    kubeconfig: str | None = setting(
        None,
        "--discovery kubernetes: kubeconfig file to reach the API server (default: "
        "the pod's service account in a cluster, else $KUBECONFIG or ~/.kube/config)",
        metavar="PATH",
    )
    watch_timeout_s: float = setting(
        300.0,
        "--discovery kubernetes: seconds one EndpointSlice watch lasts before the "
        "router watches again from where it was",
        flag="--discovery-watch-timeout-s",
    )

    @property
    def kubernetes(self) -> bool:
        return self.discovery == "kubernetes"

    def validate(self) -> None:
        if self.kubernetes and not self.discovery_deployment:
            raise SettingError(
                "--discovery-deployment",
                "--discovery kubernetes needs the TandemDeployment to follow",
            )
        if self.watch_timeout_s < 1:
            raise SettingError("--discovery-watch-timeout-s", "must be at least 1 second")


@dataclass(frozen=True)
class RouterCommand:
    """The router's command line: where it listens and what it serves, how it
    finds its engines, then whatever else the user passes."""

    launch: RouterLaunchSettings = field(default_factory=RouterLaunchSettings)
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    extra: tuple[str, ...] = ()
    rate_limits: RateLimitSettings = field(default_factory=RateLimitSettings)

    def argv(self, python: str = "python", *, joined: bool = False) -> list[str]:
        return [
            python,
            "-m",
            "services.router",
            *to_argv(self.launch, ("host", "port"), joined=joined),
            *to_argv(self.discovery, joined=joined),
            *to_argv(self.rate_limits, joined=joined),
            *self.extra,
        ]
