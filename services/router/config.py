"""Router settings: one object, built from flags (each also read from an
environment variable ``TANDEM_ROUTER_<NAME>``), validated once at start."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from services.router.auth import read_keys_file
from services.router.retention import POLICIES as RETENTION_POLICIES
from services.router.retention import RetentionSettings
from services.router.routing import (PodSpec, RoutingSettings, add_routing_arguments,
                                     routing_settings_from_args)


def _env(name: str, default):
    return os.environ.get(f"TANDEM_ROUTER_{name.upper()}", default)


def _comma_list(values: list[str] | None) -> list[str]:
    """Accept repeated flags and comma-separated lists alike."""
    out: list[str] = []
    for value in values or []:
        out.extend(a.strip() for a in value.split(",") if a.strip())
    return out


@dataclass(frozen=True)
class KvEventSource:
    pod: str  # the pod's gRPC address, as the router names pods
    endpoint: str  # PUB endpoint, e.g. tcp://127.0.0.1:5701
    replay_endpoint: str | None = None  # ROUTER endpoint, e.g. tcp://127.0.0.1:5702


def parse_kv_event_source(text: str) -> KvEventSource:
    """``POD=PUB_ENDPOINT[,REPLAY_ENDPOINT]``."""
    pod, sep, rest = text.partition("=")
    if not sep or not pod or not rest:
        raise argparse.ArgumentTypeError(
            f"--kv-events {text!r}: expected POD=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]")
    endpoint, _, replay = rest.partition(",")
    return KvEventSource(pod.strip(), endpoint.strip(), replay.strip() or None)


@dataclass(frozen=True)
class RouterSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    kv_events: tuple[KvEventSource, ...] = ()
    model: str | None = None
    served_model_name: str | None = None
    poll_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    shutdown_grace_s: float = 30.0
    max_concurrent_requests: int = 256  # 0: no limit
    max_queued_requests: int = 512
    queue_timeout_s: float = 30.0
    # Not in repr: settings must be printable without leaking keys.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    retention: RetentionSettings = field(default_factory=RetentionSettings)

    def pods(self) -> list[PodSpec]:
        """The pods the flags name."""
        events = {s.pod: s for s in self.kv_events}

        def spec(address: str, role: str) -> PodSpec:
            source = events.get(address)
            return PodSpec(address, role, source.endpoint if source else None,
                           source.replay_endpoint if source else None)

        return ([spec(a, "prefill") for a in self.prefill]
                + [spec(a, "decode") for a in self.decode]
                + [spec(a, "both") for a in self.engines])

    def validate(self) -> None:
        self.retention.validate()
        if self.prefill and not self.decode:
            raise ValueError("--prefill needs at least one --decode pod to hand KV to")
        if not (self.decode or self.engines):
            raise ValueError("no engine pods: give --decode (with --prefill for P/D) "
                             "or --engine for aggregated engines")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port {self.port}: not a TCP port")
        pods = set(self.prefill) | set(self.decode) | set(self.engines)
        unknown = [s.pod for s in self.kv_events if s.pod not in pods]
        if unknown:
            raise ValueError(f"--kv-events names pods that are not configured: {unknown}")
        named = [s.pod for s in self.kv_events]
        if len(named) != len(set(named)):
            raise ValueError("--kv-events names a pod twice")
        if self.max_concurrent_requests < 0 or self.max_queued_requests < 0:
            raise ValueError("--max-concurrent-requests and --max-queued-requests "
                             "cannot be negative")
        if self.queue_timeout_s <= 0:
            raise ValueError(f"--queue-timeout {self.queue_timeout_s:g}: must be positive "
                             "(use --max-queued-requests 0 to refuse instead of queueing)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem-router",
        description=(
            "Tandem router: the OpenAI-compatible HTTP entry point "
            "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics). "
            "Tokenizes once with the model's chat template and sends token ids over "
            "gRPC: Prefill on a prefill pod, then Generate on a decode pod with the "
            "KV hand-off parameters. Pods are host:port gRPC addresses."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default=_env("host", "127.0.0.1"), help="HTTP listen address")
    parser.add_argument("--port", type=int, default=int(_env("port", 8000)), help="HTTP port")
    parser.add_argument("--prefill", action="append",
                        default=[_env("prefill", "")] if _env("prefill", "") else None,
                        help="prefill pod gRPC address (repeat or comma-separate)")
    parser.add_argument("--decode", action="append",
                        default=[_env("decode", "")] if _env("decode", "") else None,
                        help="decode pod gRPC address (repeat or comma-separate)")
    parser.add_argument("--engine", action="append", dest="engines",
                        default=[_env("engines", "")] if _env("engines", "") else None,
                        help="aggregated engine (role both) gRPC address; serves whole "
                        "requests without a P/D split")
    parser.add_argument("--kv-events", action="append", type=parse_kv_event_source, default=[],
                        metavar="POD=PUB[,REPLAY]",
                        help="subscribe to a pod's vLLM KV events (repeat per pod); pods "
                        "without events get predicted index entries")
    parser.add_argument("--model", default=_env("model", None),
                        help="model folder for the tokenizer and chat template "
                        "(default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=_env("served_model_name", None),
                        help="model name clients send (default: the engines' name)")
    parser.add_argument("--poll-interval", type=float, dest="poll_interval_s",
                        default=float(_env("poll_interval", 1.0)),
                        help="seconds between health/load polls of each pod")
    parser.add_argument("--request-timeout", type=float, dest="request_timeout_s",
                        default=float(_env("request_timeout", 600)),
                        help="seconds a request may take end to end")
    parser.add_argument("--shutdown-grace", type=float, dest="shutdown_grace_s",
                        default=float(_env("shutdown_grace", 30)),
                        help="on SIGTERM, seconds in-flight requests may finish")
    _add_admission_arguments(parser)
    _add_retention_arguments(parser)
    add_routing_arguments(parser)
    return parser


def _add_retention_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "KV store retention hints",
        "With the shared KV store (services/kvstore), tell the engines which KV to keep: "
        "blocks written by an active session's requests are soft-pinned (evicted only "
        "after unpinned KV) for --kv-retention-ttl; a request carrying the session-end "
        "header releases the session (its blocks that no other active session shares are "
        "removed). Engines without the store ignore the hints.")
    g.add_argument("--kv-retention", choices=RETENTION_POLICIES,
                   default=_env("kv_retention", "named-sessions"),
                   help="which sessions are pinned: sessions the client names (session "
                   "header or `user`), all sessions (also those derived from the opening "
                   "messages), or none")
    g.add_argument("--kv-retention-ttl", type=float, dest="kv_retention_ttl_s",
                   metavar="SECONDS", default=float(_env("kv_retention_ttl", 1800)),
                   help="how long a session's KV blocks stay pinned after they are written; "
                   "a session idle this long is released (its pins have lapsed)")
    g.add_argument("--session-end-header", default=_env("session_end_header", "x-session-end"),
                   help="request header (value 1/true/yes) marking a session's last request")


def _add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "admission and API keys",
        "Generation requests (POST /v1/chat/completions, /v1/completions) beyond "
        "--max-concurrent-requests wait in FIFO order; beyond --max-queued-requests, or "
        "after --queue-timeout, they get 429 with Retry-After. With any API key set, "
        "every request except /health and /metrics needs 'Authorization: Bearer <key>' "
        "(else 401).")
    g.add_argument("--max-concurrent-requests", type=int, metavar="N",
                   default=int(_env("max_concurrent_requests", 256)),
                   help="generation requests served at once (0: no limit, no queue)")
    g.add_argument("--max-queued-requests", type=int, metavar="N",
                   default=int(_env("max_queued_requests", 512)),
                   help="generation requests that may wait for a slot (0: refuse at once)")
    g.add_argument("--queue-timeout", type=float, dest="queue_timeout_s", metavar="SECONDS",
                   default=float(_env("queue_timeout", 30)),
                   help="seconds a request may wait for a slot before it gets 429")
    # The environment's keys are merged in parse_settings, not used as the
    # default here: --help prints defaults, and must never print a key.
    g.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                   help="accepted API key (repeat or comma-separate; env "
                   "TANDEM_ROUTER_API_KEYS). Visible in the process list: prefer "
                   "--api-keys-file or the environment variable")
    g.add_argument("--api-keys-file", default=_env("api_keys_file", None), metavar="PATH",
                   help="file of accepted API keys, one per line; blank lines and lines "
                   "starting with '#' are skipped")


def parse_settings(argv: list[str] | None = None) -> RouterSettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        routing = routing_settings_from_args(args)
        api_keys = _comma_list([_env("api_keys", "")] + (args.api_keys or []))
        if args.api_keys_file:
            api_keys += read_keys_file(args.api_keys_file)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    settings = RouterSettings(
        host=args.host, port=args.port, prefill=_comma_list(args.prefill),
        decode=_comma_list(args.decode), engines=_comma_list(args.engines),
        kv_events=tuple(args.kv_events), model=args.model,
        served_model_name=args.served_model_name, poll_interval_s=args.poll_interval_s,
        request_timeout_s=args.request_timeout_s, shutdown_grace_s=args.shutdown_grace_s,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests, queue_timeout_s=args.queue_timeout_s,
        api_keys=tuple(dict.fromkeys(api_keys)), routing=routing,
        retention=RetentionSettings(policy=args.kv_retention, ttl_s=args.kv_retention_ttl_s,
                                    end_header=args.session_end_header))
    try:
        settings.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return settings
