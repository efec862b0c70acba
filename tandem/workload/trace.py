"""The AgentX trace format (the kv-cache-tester / "Weka" capture format that the
SemiAnalysis AgentX benchmark replays), read and written without loss.

One trace is one agent session, a JSON object::

    {"id": "f64a8d4c", "models": ["m"], "block_size": 64, "hash_id_scope": "global",
     "requests": [
        {"t": 0.0, "type": "s", "in": 741, "out": 86, "hash_ids": [1, 2, ...],
         "think_time": 0.0, "api_time": 2.1, ...},
        {"type": "subagent", "agent_id": "sa1", "t": 12.5, "requests": [...]},
        ...]}

* ``t`` seconds since the session started; ``type`` ``"s"`` (streaming) or
  ``"n"`` (non-streaming) for a model call, ``"subagent"`` for a nested session.
* ``in`` / ``out`` input and output tokens; ``hash_ids`` one id per
  ``block_size`` tokens of the input (``ceil(in / block_size)`` ids): equal ids
  mean equal blocks. With ``hash_id_scope`` ``"local"`` (the default when the
  field is missing) ids are private to the trace; with ``"global"`` they are
  shared across traces (e.g. the same tool definitions).
* ``think_time`` the client-side pause before the request is sent.
* Consecutive ``subagent`` entries are spawned together after the preceding
  request; the parent's next request waits until all of them have finished.

Files: ``.jsonl`` (one trace per line, what ``dump`` writes), ``.json`` (one
trace, or an array of traces), or a directory of such files. Every error names
the file, the line or session, and the field at fault.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCOPES = ("local", "global")
_REQUEST_KEYS = {"t", "type", "in", "out", "hash_ids", "think_time", "api_time"}
_SUBAGENT_KEYS = {"type", "agent_id", "t", "requests"}
_SESSION_KEYS = {"id", "block_size", "hash_id_scope", "models", "requests"}


class TraceError(ValueError):
    """A trace file that cannot be used, with where and why."""


@dataclass
class Request:
    """One model call of a session."""

    t: float
    in_tokens: int
    out_tokens: int
    hash_ids: list[int]
    type: str = "s"
    think_time: float | None = None
    api_time: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "t": self.t,
            "type": self.type,
            "in": self.in_tokens,
            "out": self.out_tokens,
            "hash_ids": list(self.hash_ids),
        }
        if self.think_time is not None:
            d["think_time"] = self.think_time
        if self.api_time is not None:
            d["api_time"] = self.api_time
        d.update(self.extra)
        return d


@dataclass
class Subagent:
    """A nested session spawned by its parent (which waits for it)."""

    requests: list[Entry]
    agent_id: str = ""
    t: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": "subagent"}
        if self.agent_id:
            d["agent_id"] = self.agent_id
        if self.t is not None:
            d["t"] = self.t
        d["requests"] = [e.to_json() for e in self.requests]
        d.update(self.extra)
        return d


Entry = Request | Subagent


@dataclass
class Session:
    """One trace: an agent session with its requests and sub-agents."""

    id: str
    block_size: int
    requests: list[Entry]
    hash_id_scope: str = "local"
    models: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "block_size": self.block_size,
            "hash_id_scope": self.hash_id_scope,
        }
        if self.models:
            d["models"] = list(self.models)
        d.update(self.extra)
        d["requests"] = [e.to_json() for e in self.requests]
        return d

    def iter_requests(self) -> Iterator[tuple[tuple[str, ...], int, Request]]:
        """Every model call as (agent path, index within its agent, request),
        parents before the sub-agents they spawn; the path is () for the root."""
        yield from _walk(self.requests, ())


def _walk(entries: list[Entry], path: tuple[str, ...]):
    index = 0
    for i, e in enumerate(entries):
        if isinstance(e, Request):
            yield path, index, e
            index += 1
        else:
            yield from _walk(e.requests, path + (e.agent_id or f"sa{i}",))


# --------------------------------------------------------------------- parsing


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Ctx:
    def __init__(self, where: str):
        self.where = where

    def fail(self, field_path: str, msg: str) -> TraceError:
        return TraceError(f"{self.where}: {field_path}: {msg}")


def parse_session(obj: Any, where: str = "<trace>") -> Session:
    """Validate one decoded JSON object and build a Session (TraceError if bad)."""
    ctx = _Ctx(where)
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object per session, got {type(obj).__name__}")
    sid = obj.get("id")
    if not isinstance(sid, str) or not sid:
        raise ctx.fail("id", f"must be a non-empty string, got {sid!r}")
    ctx.where = f"{where}: session {sid!r}"
    bs = obj.get("block_size")
    if not _is_int(bs) or bs <= 0:
        raise ctx.fail("block_size", f"must be a positive integer, got {bs!r}")
    scope = obj.get("hash_id_scope", "local")
    if scope not in SCOPES:
        raise ctx.fail("hash_id_scope", f"must be one of {list(SCOPES)}, got {scope!r}")
    models = obj.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise ctx.fail("models", "must be a list of strings")
    if "requests" not in obj:
        raise ctx.fail("requests", "missing")
    entries = _parse_entries(obj["requests"], "requests", bs, ctx)
    if not any(True for _ in _walk(entries, ())):
        raise ctx.fail("requests", "holds no model call")
    extra = {k: v for k, v in obj.items() if k not in _SESSION_KEYS}
    return Session(
        id=sid, block_size=bs, requests=entries, hash_id_scope=scope, models=models, extra=extra
    )


def _parse_entries(raw: Any, path: str, bs: int, ctx: _Ctx) -> list[Entry]:
    if not isinstance(raw, list) or not raw:
        raise ctx.fail(path, "must be a non-empty list")
    out: list[Entry] = []
    for i, r in enumerate(raw):
        p = f"{path}[{i}]"
        if not isinstance(r, dict):
            raise ctx.fail(p, f"must be an object, got {type(r).__name__}")
        kind = r.get("type")
        if kind == "subagent":
            out.append(_parse_subagent(r, p, bs, ctx))
        elif kind in ("s", "n"):
            out.append(_parse_request(r, p, bs, ctx))
        else:
            raise ctx.fail(f"{p}.type", f"must be 's', 'n' or 'subagent', got {kind!r}")
    return out


def _parse_subagent(r: dict, p: str, bs: int, ctx: _Ctx) -> Subagent:
    agent_id = r.get("agent_id", "")
    if not isinstance(agent_id, str):
        raise ctx.fail(f"{p}.agent_id", f"must be a string, got {agent_id!r}")
    t = r.get("t")
    if t is not None and not _is_num(t):
        raise ctx.fail(f"{p}.t", f"must be a number, got {t!r}")
    if "requests" not in r:
        raise ctx.fail(f"{p}.requests", "missing")
    entries = _parse_entries(r["requests"], f"{p}.requests", bs, ctx)
    extra = {k: v for k, v in r.items() if k not in _SUBAGENT_KEYS}
    return Subagent(requests=entries, agent_id=agent_id, t=t, extra=extra)


def _parse_request(r: dict, p: str, bs: int, ctx: _Ctx) -> Request:
    for key in ("t", "in", "out", "hash_ids"):
        if key not in r:
            raise ctx.fail(f"{p}.{key}", "missing")
    t = r["t"]
    if not _is_num(t) or t < 0:
        raise ctx.fail(f"{p}.t", f"must be a number >= 0, got {t!r}")
    n_in, n_out = r["in"], r["out"]
    if not _is_int(n_in) or n_in <= 0:
        raise ctx.fail(f"{p}.in", f"must be an integer > 0, got {n_in!r}")
    if not _is_int(n_out) or n_out < 0:
        raise ctx.fail(f"{p}.out", f"must be an integer >= 0, got {n_out!r}")
    ids = r["hash_ids"]
    if not isinstance(ids, list):
        raise ctx.fail(f"{p}.hash_ids", f"must be a list of integers, got {type(ids).__name__}")
    for j, h in enumerate(ids):
        if isinstance(h, list):
            raise ctx.fail(f"{p}.hash_ids[{j}]", "nested hash_ids lists are not supported")
        if not _is_int(h):
            raise ctx.fail(f"{p}.hash_ids[{j}]", f"must be an integer, got {h!r}")
    want = math.ceil(n_in / bs)
    if len(ids) != want:
        raise ctx.fail(
            f"{p}.hash_ids",
            f"has {len(ids)} ids, expected ceil(in={n_in} / block_size={bs}) = {want}",
        )
    opt: dict[str, float | None] = {}
    for key in ("think_time", "api_time"):
        v = r.get(key)
        if v is not None and (not _is_num(v) or v < 0):
            raise ctx.fail(f"{p}.{key}", f"must be a number >= 0, got {v!r}")
        opt[key] = float(v) if v is not None else None
    extra = {k: v for k, v in r.items() if k not in _REQUEST_KEYS}
    return Request(
        t=float(t),
        in_tokens=n_in,
        out_tokens=n_out,
        hash_ids=list(ids),
        type=r["type"],
        think_time=opt["think_time"],
        api_time=opt["api_time"],
        extra=extra,
    )


# ------------------------------------------------------------------ file I/O


def _decode(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        truncated = e.pos >= len(text.rstrip()) - 1 or e.msg.startswith("Unterminated string")
        kind = "truncated" if truncated else "invalid"
        raise TraceError(
            f"{where}: {kind} JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None


def _load_file(path: Path) -> list[Session]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason})") from None
    if not text.strip():
        raise TraceError(f"{path}: empty file")
    if path.suffix == ".jsonl":
        sessions = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                where = f"{path} line {n}"
                sessions.append(parse_session(_decode(line, where), where))
        return sessions
    obj = _decode(text, str(path))
    if isinstance(obj, list):
        return [parse_session(o, f"{path} [{i}]") for i, o in enumerate(obj)]
    return [parse_session(obj, str(path))]


def load(path: str | Path) -> list[Session]:
    """Read traces from a .jsonl/.json file or a directory of them."""
    path = Path(path)
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix in (".json", ".jsonl") and p.name != "manifest.json"
        )
        if not files:
            raise TraceError(f"{path}: directory holds no .json or .jsonl trace file")
    elif path.is_file():
        files = [path]
    else:
        raise TraceError(f"{path}: no such file or directory")
    sessions: list[Session] = []
    seen: dict[str, str] = {}
    for f in files:
        for s in _load_file(f):
            if s.id in seen:
                raise TraceError(f"{f}: session {s.id!r}: id: duplicate (also in {seen[s.id]})")
            seen[s.id] = str(f)
            sessions.append(s)
    return sessions


def dump(sessions: Iterable[Session], path: str | Path) -> Path:
    """Write traces as JSONL (one session per line); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for s in sessions:
            f.write(json.dumps(s.to_json(), separators=(",", ":")))
            f.write("\n")
    tmp.replace(path)
    return path
