"""Router settings: one object, each setting once with its default, help and
unit; the flags and the environment variables (``TANDEM_ROUTER_<FLAG>``)
derive from it (``common/settings.py``). Validated once at start."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from common.roles import Role
from common.router import RateLimitSettings, RouterLaunchSettings
from common.settings import (
    SettingError,
    add_arguments,
    comma_list,
    env_name,
    flag_of,
    from_arguments,
    group,
    setting,
)
from common.tls import GrpcClientTlsSettings
from services.router.admission import AdmissionSettings
from services.router.auth import read_keys_file
from services.router.body_limits import BodySettings
from services.router.discovery import DiscoverySettings
from services.router.retention import RetentionSettings
from services.router.routing import PodSpec, RoutingSettings

ENV_PREFIX = "TANDEM_ROUTER_"


def split_pool(item: str) -> tuple[str, str]:
    """``[POOL=]ADDRESS`` of --prefill, --decode and --engine: (pool, address)."""
    pool, sep, address = item.rpartition("=")
    return (pool.strip(), address.strip()) if sep else ("", item.strip())


@dataclass(frozen=True)
class CacheSettings:
    """Bounds of the router's caches outside the routing core (the core's own,
    and retention's, are in their groups; docs/operate.md, "Memory bounds")."""

    tokenizer_cache_sessions: int = setting(
        10_000,
        "sessions whose last turn's tokens the router keeps to tokenize only the next "
        "turn's new text (least recently used forgotten beyond: that session's next turn "
        "is tokenized in full)",
        metavar="SESSIONS",
    )
    tokenizer_cache_tokens: int = setting(
        20_000_000,
        "most tokens those sessions hold in all (about 4 bytes each, plus their text)",
        metavar="TOKENS",
    )
    responses_store_max: int = setting(
        10_000,
        "Responses API: most stored responses kept for previous_response_id (oldest "
        "forgotten beyond: continuing one is a 404 previous_response_not_found)",
        metavar="RESPONSES",
    )
    responses_store_max_chars: int = setting(
        200_000_000,
        "Responses API: most characters of message content the stored conversations "
        "hold in all (a message shared by several counts in each; oldest forgotten beyond)",
        metavar="CHARS",
    )

    def validate(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise SettingError(flag_of(CacheSettings, f.name), "must be positive")


@dataclass(frozen=True)
class RouterSettings(RouterLaunchSettings):
    """Every router setting: what a launcher sets (common/router.py, where the
    stack and the operator render it) and the rest."""

    chat_template: str | None = setting(
        None,
        "Jinja chat template file replacing the model's own, e.g. one that renders "
        "`tools` (services/router/chat_templates/chatml_tools.jinja does, for ChatML models "
        "such as SmolLM2)",
        metavar="PATH",
    )
    tool_call_parser: str | None = setting(
        None,
        "vLLM tool parser (as vLLM names them, e.g. hermes) reading tool calls from the "
        "model's text under tool_choice auto; without it, auto returns the text as content. "
        "Forced calls (required, a named function) need no parser",
        metavar="NAME",
    )
    reasoning_parser: str | None = setting(
        None,
        "vLLM reasoning parser (as vLLM names them, e.g. deepseek_r1, qwen3, olmo3) "
        "splitting a thinking model's reasoning from its answer: chat's reasoning_content, "
        "Anthropic thinking blocks, Responses reasoning items; without it, reasoning stays "
        "in the content",
        metavar="NAME",
    )
    poll_interval_s: float = setting(1.0, "seconds between health/load polls of each pod")
    engine_streams: str = setting(
        "shared",
        "how generation reaches an engine: 'shared' runs every request to an engine over one "
        "multiplexed GenerateStream call, the tokens of each engine step in one message; "
        "'per-request' opens a Generate call per request (a gRPC message per token: more "
        "router CPU)",
        choices=("shared", "per-request"),
    )
    request_timeout_s: float = setting(600.0, "seconds a request may take end to end")
    shutdown_grace_s: float = setting(
        30.0,
        "on SIGTERM, seconds in-flight requests may "
        "finish; also how long a removed pod's calls may",
    )
    body: BodySettings = group(
        BodySettings,
        "request bodies",
        "Every request body is bounded in size (413 beyond --max-body-mib) and in time "
        "(408 when it has not fully arrived --body-timeout-s after the request began), "
        "so no client can make the router buffer without bound or hold a connection by "
        "sending slowly.",
    )
    admission: AdmissionSettings = group(
        AdmissionSettings,
        "admission and API keys",
        "Generation requests (POST /v1/chat/completions, /v1/completions, /v1/messages, "
        "/v1/responses) beyond "
        "--max-concurrent-requests wait in FIFO order; beyond --max-queued-requests, or "
        "after --queue-timeout-s, they get 429 with Retry-After. With any API key set, "
        "every request except /health and /metrics needs 'Authorization: Bearer <key>' "
        "(else 401).",
    )
    rate_limits: RateLimitSettings = group(
        RateLimitSettings,
        "rate limits",
        "Per client (its API key when keys are set, else its address): requests per second "
        "over every endpoint but /health and /metrics, and prompt plus completion tokens per "
        "minute over the generation endpoints; beyond either, 429 with Retry-After "
        "(docs/operate.md, 'Rate limits').",
    )
    tls: GrpcClientTlsSettings = group(
        GrpcClientTlsSettings,
        "mutual TLS to the engines",
        "With --grpc-tls-cert, --grpc-tls-key and --grpc-tls-ca the router calls the engines "
        "over mutual TLS (the engines need the same flags); the files are checked at each "
        "health poll and the channels reopened when they change (docs/operate.md, 'mTLS'). "
        "--grpc-tls-server-name checks the engines' certificate against one name instead of "
        "the pod address dialled, as on Kubernetes.",
    )
    # Not in repr: settings must be printable without leaking keys. Not a
    # derived flag either: --api-key, --api-keys-file and the environment merge.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    discovery: DiscoverySettings = group(
        DiscoverySettings,
        "pod discovery",
        "With --discovery static (the default) the engine pods are the --prefill, --decode "
        "and --engine flags. With --discovery kubernetes the router follows the "
        "EndpointSlices of a TandemDeployment's engine pools (what the operator deploys): "
        "a pod joins once its endpoint is ready, gets no new requests once it is "
        "terminating (its streams finish) and leaves once it is gone.",
    )
    routing: RoutingSettings = group(RoutingSettings, "routing")
    caches: CacheSettings = group(
        CacheSettings,
        "memory bounds",
        "Every table that grows with traffic has a bound; these are the caches outside the "
        "routing core (whose bounds are under routing, and the KV retention's under KV store "
        "retention hints). docs/operate.md, 'Memory bounds', lists them all.",
    )
    retention: RetentionSettings = group(
        RetentionSettings,
        "KV store retention hints",
        "With the shared KV store (services/kvstore), tell the engines which KV to keep: "
        "blocks written by an active session's requests are soft-pinned (evicted only "
        "after unpinned KV) for --kv-retention-ttl-s; a request carrying the session-end "
        "header releases the session (its blocks that no other active session shares are "
        "removed). Engines without the store ignore the hints.",
    )

    def pods(self) -> list[PodSpec]:
        """The pods the flags name."""
        events = {s.pod: s for s in self.kv_events}

        def spec(item: str, role: Role) -> PodSpec:
            pool, address = split_pool(item)
            source = events.get(address)
            return PodSpec(
                address,
                role,
                source.endpoint if source else None,
                source.replay_endpoint if source else None,
                pool,
            )

        return (
            [spec(a, Role.PREFILL) for a in self.prefill]
            + [spec(a, Role.DECODE) for a in self.decode]
            + [spec(a, Role.BOTH) for a in self.engines]
        )

    def validate(self) -> None:
        self.admission.validate()
        self.rate_limits.validate()
        self.tls.validate()
        self.body.validate()
        self.routing.validate()
        self.retention.validate()
        self.caches.validate()
        self.discovery.validate()
        if self.discovery.kubernetes:
            if self.prefill or self.decode or self.engines or self.kv_events:
                raise SettingError(
                    "--discovery",
                    "kubernetes finds the pods itself: drop "
                    "--prefill, --decode, --engine and --kv-events",
                )
        elif self.prefill and not self.decode:
            raise SettingError("--prefill", "needs at least one --decode pod to hand KV to")
        elif not (self.decode or self.engines):
            raise SettingError(
                "--decode",
                "no engine pods: give --decode (with --prefill "
                "for P/D) or --engine for aggregated engines",
            )
        if self.max_migrations < 0:
            raise SettingError("--max-migrations", "must be 0 (off) or more")
        if not 0 < self.port < 65536:
            raise SettingError("--port", f"{self.port}: not a TCP port")
        pods = {split_pool(item)[1] for item in self.prefill + self.decode + self.engines}
        unknown = [s.pod for s in self.kv_events if s.pod not in pods]
        if unknown:
            raise SettingError("--kv-events", f"names pods that are not configured: {unknown}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise SettingError("--chat-template", f"{self.chat_template}: no such file")
        named = [s.pod for s in self.kv_events]
        if len(named) != len(set(named)):
            raise SettingError("--kv-events", "names a pod twice")
        prefill_pools = {split_pool(item)[0] for item in self.prefill}
        missing = [
            str(a) for a in self.routing.policy.prefill_pool_for if a.pool not in prefill_pools
        ]
        if missing and not self.discovery.kubernetes:
            raise SettingError(
                "--prefill-pool-for",
                f"{', '.join(missing)}: no --prefill pod of that pool (--prefill POOL=ADDR)",
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem-router",
        description=(
            "Tandem router: the OpenAI-compatible HTTP entry point "
            "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics). "
            "Tokenizes once with the model's chat template and sends token ids over "
            "gRPC: Prefill on a prefill pod, then Generate on a decode pod with the "
            "KV hand-off parameters. Pods are host:port gRPC addresses. Every flag "
            f"also reads an environment variable {ENV_PREFIX}<FLAG>."
        ),
    )
    groups = add_arguments(parser, RouterSettings, ENV_PREFIX)
    keys = groups["admission and API keys"]
    # The environment's keys are merged in parse_settings, not used as the
    # default here: --help prints defaults, and must never print a key.
    keys.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="KEY",
        help="accepted API key (repeat or comma-separate; env "
        f"{ENV_PREFIX}API_KEYS). Visible in the process list: prefer "
        "--api-keys-file or the environment variable",
    )
    keys.add_argument(
        "--api-keys-file",
        metavar="PATH",
        help="file of accepted API keys, one per line; blank lines and lines "
        "starting with '#' are skipped "
        f"(env {env_name(ENV_PREFIX, '--api-keys-file')})",
    )
    return parser


def parse_settings(argv: list[str] | None = None) -> RouterSettings:
    try:
        parser = build_parser()
    except SettingError as exc:  # a bad value in the environment
        raise SystemExit(f"tandem-router: error: {exc}") from None
    args = parser.parse_args(argv)
    try:
        api_keys = comma_list(os.environ.get(f"{ENV_PREFIX}API_KEYS", ""))
        for value in args.api_keys or []:
            api_keys += comma_list(value)
        keys_file = args.api_keys_file or os.environ.get(env_name(ENV_PREFIX, "api-keys-file"))
        if keys_file:
            api_keys += read_keys_file(keys_file)
        settings: RouterSettings = from_arguments(
            RouterSettings, args, api_keys=tuple(dict.fromkeys(api_keys))
        )
        settings.validate()
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    return settings
