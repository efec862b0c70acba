"""Session retention hints: what the router tells engines to keep in the KV store.

Per request, from the routing decision (the prompt's block hashes) and the
session key, :class:`SessionRetention` returns the ``RetentionHint`` the
engines get (``services/kvstore/retention.py`` explains what an engine does
with it):

* a request of an active session → ``pin_ttl_ms``: the KV blocks it writes to
  the store are soft-pinned for ``--kv-retention-ttl-s`` seconds, so pressure
  from other traffic evicts unpinned KV first;
* the session's last request (the client sends ``--session-end-header``) →
  ``release``: once written, the session's blocks are removed from the store,
  except the prefix other active sessions share (``keep_tokens``). A shared
  system prompt or a parent context a live sub-agent forked stays.
* a session that just stops sending is released by its pins lapsing: each
  block's pin lasts ``--kv-retention-ttl-s`` from when it was written (Mooncake
  pins are set at write time; reads do not renew them), so after that long
  without a turn the session's KV is ordinary LRU cache again. The router
  forgets such a session after the same time.

Sharing is computed from the latest prompt of every session this router
replica saw within the TTL: block i of a session is shared when another
active session's latest prompt has the same block-hash chain up to i.
Several router replicas each see only their own sessions (docs/operate.md,
"Several router replicas and Redis").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from common.settings import SettingError, flag_of, setting
from services.kvstore.retention import RetentionHint
from services.router.routing.lru import BoundedLru

POLICIES = ("off", "named-sessions", "all-sessions")
# Session key sources (services/router/routing/sessions.py) a policy pins.
_PINNED_SOURCES = {
    "off": frozenset(),
    "named-sessions": frozenset({"header", "user"}),
    "all-sessions": frozenset({"header", "user", "derived"}),
}


@dataclass(frozen=True)
class RetentionSettings:
    policy: str = setting(
        "named-sessions",
        "which sessions are pinned: sessions the client "
        "names (session header or `user`), all sessions (also those derived "
        "from the opening messages), or none",
        flag="--kv-retention",
        choices=POLICIES,
    )
    ttl_s: float = setting(
        1800.0,
        "how long a session's KV blocks stay pinned after they "
        "are written; a session idle this long is released (its pins "
        "have lapsed)",
        flag="--kv-retention-ttl-s",
    )
    end_header: str = setting(
        "x-session-end",
        "request header (value 1/true/yes) marking a session's last request",
        flag="--session-end-header",
    )
    max_sessions: int = setting(
        100_000,
        "most sessions whose latest prompt the router keeps to compute shared "
        "prefixes (least recently seen forgotten beyond: a release then keeps "
        "less of a prefix they share)",
        flag="--kv-retention-max-sessions",
        metavar="SESSIONS",
    )
    max_blocks: int = setting(
        4_000_000,
        "most block hashes those prompts hold in all (least recently seen sessions "
        "forgotten beyond)",
        flag="--kv-retention-max-blocks",
        metavar="BLOCKS",
    )

    def validate(self) -> None:
        for name in ("max_sessions", "max_blocks"):
            if getattr(self, name) <= 0:
                raise SettingError(flag_of(RetentionSettings, name), "must be positive")
        if self.policy not in POLICIES:
            raise SettingError(
                flag_of(RetentionSettings, "policy"),
                f"{self.policy!r}: must be one of {', '.join(POLICIES)}",
            )
        if not 0 < self.ttl_s <= 86400:
            # The KV store's master refuses pins longer than a day by default.
            raise SettingError(
                flag_of(RetentionSettings, "ttl_s"),
                f"{self.ttl_s:g}: must be in (0, 86400] seconds",
            )


@dataclass
class _Session:
    hashes: tuple[int, ...]
    last_seen: float


class SessionRetention:
    """Tracks active sessions' latest prompts; builds each request's hint."""

    def __init__(self, settings: RetentionSettings, block_size: int) -> None:
        settings.validate()
        self.settings = settings
        self.block_size = block_size
        # Least recently seen first; the bounds forget sessions before their TTL.
        self._sessions: BoundedLru[str, _Session] = BoundedLru(
            settings.max_sessions,
            settings.max_blocks,
            weigh=lambda s: len(s.hashes),
            on_drop=self._dropped,
        )
        self._refs: Counter[int] = Counter()  # block hash → active sessions holding it
        self.pins = 0
        self.releases = 0

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    @property
    def held_blocks(self) -> int:
        return self._sessions.weight

    @property
    def evictions(self) -> int:
        return self._sessions.evictions

    def hint(
        self,
        session: str | None,
        source: str | None,
        hashes: Sequence[int],
        now: float,
        end: bool = False,
    ) -> RetentionHint | None:
        """The hint for one request (None: nothing to say).

        ``session``/``source`` come from ``session_key``; ``hashes`` are the
        prompt's full-block hashes (the routing decision's); ``end`` is set
        when the client marked this request as the session's last.
        """
        self._expire(now)
        if not session or source not in _PINNED_SOURCES[self.settings.policy]:
            return None
        if end:
            keep = self._shared_prefix(session, hashes)
            self._sessions.pop(session)
            self.releases += 1
            return RetentionHint(session, release=True, keep_tokens=keep * self.block_size)
        self._remember(session, tuple(hashes), now)
        self.pins += 1
        return RetentionHint(session, pin_ttl_ms=int(self.settings.ttl_s * 1000))

    # -- internals ---------------------------------------------------------
    def _shared_prefix(self, session: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` another active session's prompt also has.

        Hashes chain (each covers its whole prefix), so sharing block i means
        sharing every block before it: the shared part is a prefix.
        """
        own = self._sessions.get(session)
        own_set = set(own.hashes) if own else set()
        keep = 0
        for h in hashes:
            if self._refs[h] - (1 if h in own_set else 0) <= 0:
                break
            keep += 1
        return keep

    def _remember(self, session: str, hashes: tuple[int, ...], now: float) -> None:
        self._sessions.pop(session)
        self._refs.update(set(hashes))
        self._sessions.put(session, _Session(hashes, now))

    def _dropped(self, _session: str, old: _Session) -> None:
        self._refs.subtract(set(old.hashes))
        for h in old.hashes:
            if self._refs.get(h, 1) <= 0:
                del self._refs[h]

    def _expire(self, now: float) -> None:
        """Sessions idle past the TTL: their pins have lapsed; forget them."""
        horizon = now - self.settings.ttl_s
        while (oldest := self._sessions.oldest()) is not None and oldest[1].last_seen <= horizon:
            self._sessions.pop(oldest[0])
