"""Block hashes carried forward from a session's previous turn.

A turn of an agent session repeats the previous turn's prompt and appends to
it; its leading blocks are the previous turn's blocks, with the same hashes
(each block's hash chains from its parent's). ``HashChains`` keeps, per
session, the latest prompt's token ids and block hashes, and hashes only the
blocks after the longest common prefix of full blocks: a turn costs its new
blocks, not its whole context.

A sub-agent forks its parent's context under a session of its own: a session
seen for the first time continues the chain of the latest session whose
first block had the same tokens (and the same cache salt and LoRA), if the
two prompts share more than that block.

The result is always what ``BlockHasher.event_hashes`` gives for the whole
prompt (``tests/router/routing/test_chains.py`` checks it on edited,
truncated and forked histories). Memory is bounded by what it holds most of,
tokens (4 bytes each; a block's hashes, about 100 bytes, come with every
``block_size`` of them): at most ``max_sessions`` chains holding
``max_tokens`` tokens in all, least recently used out (its next turn is
hashed in full).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from services.router.routing.hashing import BlockHasher, to_event_hash
from services.router.routing.lru import BoundedLru
from services.router.routing.sessions import common_prefix_len

_ITEM = array("I").itemsize


@dataclass(frozen=True)
class _Chain:
    extra: tuple[str | None, tuple[str, str] | None]  # (cache salt, LoRA): part of every hash
    tokens: bytes  # the prompt's token ids, packed (``array("I")``): compared as bytes
    full: list[bytes]  # full-width hashes of its full blocks (the next block's parent)
    events: list[int]  # the same as KV events carry them


class HashChains:
    def __init__(
        self, hasher: BlockHasher, max_sessions: int = 100_000, max_tokens: int = 20_000_000
    ) -> None:
        self._hasher = hasher
        self._chains: BoundedLru[str, _Chain] = BoundedLru(
            max_sessions, max_tokens, weigh=lambda c: len(c.tokens) // _ITEM, on_drop=self._forget
        )
        # (cache salt, LoRA, first block's tokens) -> the latest session that began so.
        self._by_opening: dict[tuple[object, ...], str] = {}
        self.hashed_blocks = 0  # blocks hashed
        self.reused_blocks = 0  # blocks whose hash a previous turn (or the parent) gave

    def __len__(self) -> int:
        return len(self._chains)

    @property
    def tokens(self) -> int:
        """Tokens the chains hold in all."""
        return self._chains.weight

    @property
    def evictions(self) -> int:
        return self._chains.evictions

    def event_hashes(
        self,
        token_ids: Sequence[int],
        session: str | None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[int]:
        """The prompt's block hashes as KV events carry them; with a
        ``session``, its chain is carried forward and remembered."""
        hasher = self._hasher
        if session is None:
            return self._count(hasher.event_hashes(token_ids, cache_salt, lora), 0)
        try:
            packed = array("I", token_ids).tobytes()
        except (OverflowError, TypeError):  # ids no tokenizer gives: nothing to carry
            return self._count(hasher.event_hashes(token_ids, cache_salt, lora), 0)
        extra = (cache_salt, lora)
        bs = hasher.block_size
        opening = (extra, packed[: bs * _ITEM])
        prev = self._chains.get(session)
        if prev is None or prev.extra != extra:
            parent = self._by_opening.get(opening)
            prev = self._chains.get(parent) if parent is not None else None
        reuse = 0
        if prev is not None and prev.extra == extra:
            common = common_prefix_len(prev.tokens, packed) // _ITEM
            reuse = min(common // bs, len(prev.full))
        full = prev.full[:reuse] if prev is not None and reuse else []
        events = prev.events[:reuse] if prev is not None and reuse else []
        new = hasher.block_hashes(
            token_ids[reuse * bs :], cache_salt, lora, start_parent=full[-1] if full else None
        )
        full.extend(new)
        events.extend(to_event_hash(h) for h in new)
        self._chains.put(session, _Chain(extra, packed, full, events))
        if len(packed) >= bs * _ITEM:
            self._by_opening[opening] = session
        self.reused_blocks += reuse
        return self._count(events, reuse)

    def forget(self, session: str) -> None:
        """The session ended: its chain is not needed again."""
        self._chains.pop(session)

    def _count(self, events: list[int], reused: int) -> list[int]:
        self.hashed_blocks += len(events) - reused
        return events

    def _forget(self, session: str, chain: _Chain) -> None:
        bs = self._hasher.block_size
        opening = (chain.extra, chain.tokens[: bs * _ITEM])
        if self._by_opening.get(opening) == session:
            del self._by_opening[opening]
