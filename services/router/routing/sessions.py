"""Who a request belongs to, and its tokens without re-tokenizing the history.

Session identity, first match wins: the configured header (default
``x-session-id``), the OpenAI ``user`` field, else a key derived from the
conversation's opening messages (its system prompt and first user message), so
agents that send nothing still stick to one pod from turn to turn. Sub-agents
that fork a parent's context with new opening messages get their own key and
find the parent's pod through the prefix index instead.

Incremental tokenization: each turn of a session renders the whole chat to
text; a new turn usually extends the previous one. Tokenizers split text on
special tokens before anything else, so the tokens up to the last special
token inside the common prefix of the two texts are reused and only the rest
is tokenized. Anything else (an edited history, a different template output)
falls back to full tokenization. ``tests/router/routing/test_sessions.py``
checks the result equals full tokenization.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from services.router.routing.lru import BoundedLru

DEFAULT_SESSION_HEADER = "x-session-id"
# How much of a rendered chat names its opening (the template's header and
# the start of the system prompt) for finding a sub-agent's parent.
OPENING_CHARS = 256


@dataclass(frozen=True)
class SessionKey:
    key: str
    source: str  # "header", "user" or "derived"


def session_key(
    headers: Mapping[str, str],
    body: Mapping[str, Any] | None,
    header_name: str = DEFAULT_SESSION_HEADER,
) -> SessionKey | None:
    """The request's session: header, else ``user``, else derived from messages."""
    wanted = header_name.lower()
    for name, value in headers.items():
        if name.lower() == wanted and value:
            return SessionKey(f"h:{value}", "header")
    body = body or {}
    user = body.get("user")
    if isinstance(user, str) and user:
        return SessionKey(f"u:{user}", "user")
    derived = derive_session_key(body.get("messages"), body.get("prompt"))
    return SessionKey(derived, "derived") if derived else None


def derive_session_key(
    messages: Sequence[Mapping[str, Any]] | None, prompt: Any = None
) -> str | None:
    """A stable key from what every turn of one conversation repeats.

    The system message(s) and the first user message are the opening of the
    conversation and do not change as it grows. For raw completions the first
    256 characters of the prompt play the same role.
    """
    opening: list[Any] = []
    if messages:
        for message in messages:
            role = message.get("role")
            opening.append([role, message.get("content")])
            if role == "user":
                break
    elif isinstance(prompt, str) and prompt:
        opening.append(prompt[:256])
    if not opening:
        return None
    digest = hashlib.sha256(json.dumps(opening, sort_keys=True, default=str).encode())
    return "d:" + digest.hexdigest()[:32]


@dataclass
class _Tokenized:
    text: str
    ids: array[int]  # 4 bytes a token, where a list takes about 36
    # (char offset just past a special token, number of tokens up to it), ascending.
    cuts: list[tuple[int, int]]


@dataclass
class TokenizeStats:
    full: int = 0
    incremental: int = 0
    reused_tokens: int = 0
    tokenized_chars: int = 0


def backend_encoder(tokenizer: Any) -> Any:
    """A private copy of a Hugging Face fast tokenizer's Rust backend, set up
    as ``tokenizer(text, ...)`` sets it up for every call (no truncation, no
    padding; special tokens in the text matched unless the tokenizer splits
    them): the same ids and offsets without the Python wrapper, which costs
    more per call than encoding a new chat turn takes."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return backend


Text = TypeVar("Text", str, bytes, list[int])


def common_prefix_len(a: Text, b: Text) -> int:
    """Length of the longest common prefix of two strings (byte strings, lists),
    by halving with slice comparisons (os.path.commonprefix walks the
    characters in Python, milliseconds for a long chat)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: a new turn extends the previous one
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class IncrementalTokenizer:
    """Tokenizes a session's rendered chat text, reusing the previous turn's tokens.

    ``tokenizer`` is a Hugging Face *fast* tokenizer (offsets are needed).
    At most ``max_sessions`` sessions, holding at most ``max_tokens`` tokens
    in all, are remembered (least recently used out; ``evictions`` counts
    them): a forgotten session's next turn is tokenized in full.
    """

    def __init__(
        self, tokenizer: Any, max_sessions: int = 10_000, max_tokens: int = 20_000_000
    ) -> None:
        self._tok = tokenizer
        self.encoder = backend_encoder(tokenizer)
        self._sessions: BoundedLru[str, _Tokenized] = BoundedLru(
            max_sessions, max_tokens, weigh=lambda t: len(t.ids), on_drop=self._forget
        )
        # The opening of a text -> the latest session whose text began so: a
        # sub-agent's first turn (a session of its own) reuses its parent's.
        self._by_opening: dict[str, str] = {}
        self.stats = TokenizeStats()
        # Split points are only safe after special tokens that do not swallow
        # the whitespace following them.
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._cut_ids = {
            i
            for i, t in decoder.items()
            if getattr(t, "special", False) and not getattr(t, "rstrip", False)
        }

    def render_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> str:
        text: str = self._tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **template_kwargs
        )
        return text

    def encode(self, text: str, session: str | None = None) -> list[int]:
        """Token ids of ``text`` (no special tokens added), as full tokenization gives."""
        prev = None
        if session is not None:
            prev = self._sessions.get(session)
            if prev is None and (parent := self._by_opening.get(text[:OPENING_CHARS])):
                prev = self._sessions.get(parent)
        result = self._encode_extending(prev, text) if prev is not None else None
        if result is None:
            result = self._encode_from(text, 0, array("I"), [])
            self.stats.full += 1
        else:
            self.stats.incremental += 1
        if session is not None:
            self._remember(session, result)
        return result.ids.tolist()

    @property
    def cached_sessions(self) -> int:
        return len(self._sessions)

    @property
    def cached_tokens(self) -> int:
        """Tokens the cached sessions hold, in all (what ``max_tokens`` bounds)."""
        return self._sessions.weight

    @property
    def evictions(self) -> int:
        return self._sessions.evictions

    def _remember(self, session: str, result: _Tokenized) -> None:
        self._sessions.put(session, result)
        if len(result.text) >= OPENING_CHARS:
            self._by_opening[result.text[:OPENING_CHARS]] = session

    def _forget(self, session: str, result: _Tokenized) -> None:
        opening = result.text[:OPENING_CHARS]
        if self._by_opening.get(opening) == session:
            del self._by_opening[opening]

    def _encode_extending(self, prev: _Tokenized, text: str) -> _Tokenized | None:
        common = common_prefix_len(prev.text, text)
        # The last split point fully inside the shared text.
        i = bisect.bisect_right(prev.cuts, (common, float("inf"))) - 1
        if i < 0:
            return None
        char_at, tokens_at = prev.cuts[i]
        self.stats.reused_tokens += tokens_at
        return self._encode_from(text, char_at, prev.ids[:tokens_at], prev.cuts[: i + 1])

    def _encode_from(
        self, text: str, start: int, ids: array[int], cuts: list[tuple[int, int]]
    ) -> _Tokenized:
        enc = self.encoder.encode(text[start:], add_special_tokens=False)
        new_ids = enc.ids
        self.stats.tokenized_chars += len(text) - start
        cuts = list(cuts)
        base = len(ids)
        for j, (tid, (_, end)) in enumerate(zip(new_ids, enc.offsets)):
            if tid in self._cut_ids:
                cuts.append((start + end, base + j + 1))
        ids.extend(new_ids)  # a fresh array: a new one, or a slice of the previous turn's
        return _Tokenized(text, ids, cuts)
