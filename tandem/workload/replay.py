"""The replay client: plays agentic traces against an OpenAI-compatible server.

* ``concurrency`` session lanes; each lane takes the next session from the
  trace and plays it to the end, then takes another (closed loop).
* Before each request the lane waits the trace's ``think_time`` (times
  ``think_scale``, capped by ``think_max``).
* Consecutive sub-agent entries are started together when the parent reaches
  them and run in parallel (outside the lane count: the parent's lane is blocked
  on them); the parent's next request waits for all of them.
* Every request is a streaming ``/v1/chat/completions`` call with
  ``stream_options.include_usage``, ``max_tokens`` = the trace's ``out`` and
  ``ignore_eos`` (so the output length is the trace's), built by
  ``content.PromptBuilder`` so its tokens reproduce the trace's block structure.
  Prompts are built and verified before the clock starts.
* Per request: TTFT (first non-empty content delta), E2E, ITL
  (``(e2e - ttft) / (output_tokens - 1)``), prompt / cached / output tokens from
  ``usage``. A request is ok only when its stream ends with a finish_reason,
  then ``[DONE]``, with output; otherwise its failure is recorded by kind
  (``FAILURES``: an error status or event, a broken connection, a truncated
  stream, no end within ``timeout_s``...), and the session goes on with its
  next turn as an agent would.
* Several URLs: requests go to each in turn; a refused connection is tried
  on the next (``Spread``).
* Ctrl-C (or ``duration``) stops the lanes; in-flight requests are recorded as
  interrupted and the partial results are returned (and written by the CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from .content import BuiltPrompt, PromptBuilder, scope_key
from .endpoint import is_done, output_deltas, sse_data, urls
from .metrics import INTERRUPTED
from .trace import Entry, Request, Session, Subagent


@dataclass
class ReplayConfig:
    # Base URL, e.g. http://127.0.0.1:8000. Several, comma-separated: requests
    # go to them in turn, as an Ingress spreads them over router replicas.
    url: str
    model: str
    concurrency: int = 4
    think_scale: float = 1.0
    think_max: float | None = None
    max_tokens_cap: int | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0
    duration_s: float | None = None  # stop starting new requests after this
    session_header: str = "X-Session-ID"
    # Sent (value 1) on each agent's last request, sub-agents' too, so a
    # router knows the agent's KV is not needed any more (Tandem's router:
    # x-session-end). None: the replay never says a session ended.
    session_end_header: str | None = None
    api_key: str | None = None
    progress: bool = True


@dataclass
class RequestRecord:
    session: str
    agent: str  # "" for the main agent, "sa1", "sa1/sa2", ...
    turn: int  # index of the call within its agent
    lane: int
    start: float  # seconds since the run started
    trace_in: int
    trace_out: int
    max_tokens: int
    expected_prompt_tokens: int
    ok: bool = False
    status: int | None = None
    # Why it failed (FAILURES), None when ok; `error` says it in words.
    failure: str | None = None
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None  # of a failed request: those streamed before it failed
    max_gap: float | None = None  # the longest pause between two output chunks
    response_id: str | None = None  # the server's id (the router's: its engines log it)


@dataclass
class ReplayResult:
    config: dict[str, Any]
    records: list[RequestRecord]
    started_at: float
    duration_s: float
    interrupted: bool
    salt: str
    sessions_done: int
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "interrupted": self.interrupted,
            "salt": self.salt,
            "sessions_done": self.sessions_done,
            "records": [asdict(r) for r in self.records],
        }


def build_prompts(
    sessions: list[Session], builder: PromptBuilder, on_progress: Callable[[], None] | None = None
) -> dict[int, BuiltPrompt]:
    """Every request's prompt, keyed by id(request); verifies tokenization."""
    out: dict[int, BuiltPrompt] = {}
    for s in sessions:
        builder.check_block_size(s.block_size)
        scope = scope_key(s.id, s.hash_id_scope)
        for _, _, r in s.iter_requests():
            out[id(r)] = builder.build(scope, r.hash_ids, r.in_tokens, s.block_size)
            if on_progress:
                on_progress()
    return out


class _Stop(Exception):
    pass


# RequestRecord.failure: how a request can fail.
FAILURES = {
    "http_<status>": "an error status before the stream began",
    "error_event": "an error event in the stream",
    "bad_event": "stream data that is not JSON",
    "connection_lost": "the connection broke mid-response",
    "connect_failed": "no endpoint accepted the connection",
    "truncated": "the stream ended without a finish_reason and [DONE]",
    "no_output": "it finished without one output token",
    "timeout": "no end within timeout_s",
    INTERRUPTED: "the replay was stopped (Ctrl-C) with it in flight",
}


class _Failed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


@dataclass
class _Stream:
    """What one response's stream has shown so far."""

    first: float | None = None  # when the first output delta came
    last: float | None = None
    deltas: int = 0  # output deltas
    max_gap: float = 0.0
    finished: bool = False  # a finish_reason came
    done: bool = False  # [DONE] came

    def add(self, chunk: dict[str, Any], now: float) -> bool:
        """Takes one chunk; True when it brought the first output."""
        self.finished |= any(c.get("finish_reason") for c in chunk.get("choices") or ())
        deltas = output_deltas(chunk)
        if not deltas:
            return False
        self.deltas += deltas
        if self.last is not None:
            self.max_gap = max(self.max_gap, now - self.last)
        self.last = now
        if self.first is None:
            self.first = now
            return True
        return False

    def check(self) -> None:
        """A stream that ended cleanly is complete only with a finish_reason,
        then [DONE], and some output."""
        if not (self.finished and self.done):
            missing = " and ".join(
                what
                for what, seen in (("a finish_reason", self.finished), ("[DONE]", self.done))
                if not seen
            )
            raise _Failed("truncated", f"stream ended without {missing}")
        if self.first is None:
            raise _Failed("no_output", "no output token received")


class Replayer:
    def __init__(
        self,
        cfg: ReplayConfig,
        sessions: list[Session],
        prompts: dict[int, BuiltPrompt],
        salt: str = "",
    ):
        if cfg.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.cfg = cfg
        self.sessions = sessions
        self.prompts = prompts
        self.salt = salt
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self.stopping = asyncio.Event()
        self.sessions_done = 0
        self.bar = None
        self.failures = 0
        self.streaming = 0  # responses with output streaming now

    # -- one HTTP call
    async def _call(
        self,
        client: httpx.AsyncClient,
        rec: RequestRecord,
        prompt: BuiltPrompt,
        session_key: str,
        last: bool = False,
    ) -> None:
        """One streaming request; fills `rec` (`ok`, or `failure` and `error`).
        A request still going after ``timeout_s`` is a ``timeout``."""
        body = {
            "model": self.cfg.model,
            "messages": prompt.messages,
            "max_tokens": rec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        headers = {self.cfg.session_header: session_key} if self.cfg.session_header else {}
        if last and self.cfg.session_end_header:
            headers[self.cfg.session_end_header] = "1"
        if self.cfg.api_key:
            headers["Authorization"] = f"Bearer {self.cfg.api_key}"
        t_start = time.perf_counter()
        rec.start = t_start - self.t0
        stream = _Stream()
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                await self._read(client, body, headers, rec, stream)
            rec.e2e = time.perf_counter() - t_start
            stream.check()
        except asyncio.CancelledError:
            rec.failure = rec.error = INTERRUPTED
            raise
        except _Failed as f:
            rec.failure, rec.error = f.kind, f.message
        except (TimeoutError, httpx.TimeoutException) as e:
            rec.failure = "timeout"
            rec.error = f"timeout after {self.cfg.timeout_s:.0f}s ({type(e).__name__})"
        except httpx.ConnectError as e:  # no replica accepted the connection
            rec.failure, rec.error = "connect_failed", f"ConnectError: {e}"
        except httpx.HTTPError as e:  # the connection broke mid-response
            rec.failure, rec.error = "connection_lost", f"{type(e).__name__}: {e}"
        finally:
            if rec.output_tokens is None and stream.deltas:
                rec.output_tokens = stream.deltas
        if rec.failure is not None or stream.first is None:
            return
        rec.ttft = stream.first - t_start
        assert rec.e2e is not None
        if rec.output_tokens and rec.output_tokens > 1:
            rec.itl = (rec.e2e - rec.ttft) / (rec.output_tokens - 1)
        rec.max_gap = stream.max_gap
        rec.ok = True

    async def _read(
        self,
        client: httpx.AsyncClient,
        body: dict[str, Any],
        headers: dict[str, str],
        rec: RequestRecord,
        stream: _Stream,
    ) -> None:
        """Reads one response into `rec` and `stream`; raises `_Failed` for an
        error the server sent (a status, an error event, data that is not JSON)."""
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise _Failed(
                    f"http_{resp.status_code}", f"HTTP {resp.status_code}: {_error_message(text)}"
                )
            try:
                async for line in resp.aiter_lines():
                    data = sse_data(line)
                    if data is None:
                        continue
                    if is_done(data):
                        stream.done = True
                        break
                    try:
                        ev = json.loads(data)
                    except json.JSONDecodeError:
                        raise _Failed("bad_event", f"bad SSE data: {data[:120]!r}") from None
                    if "error" in ev:
                        raise _Failed(
                            "error_event", f"error event: {_error_message(json.dumps(ev))}"
                        )
                    rec.response_id = rec.response_id or ev.get("id")
                    if stream.add(ev, time.perf_counter()):
                        self.streaming += 1
                    usage = ev.get("usage")
                    if usage:
                        rec.prompt_tokens = usage.get("prompt_tokens")
                        rec.output_tokens = usage.get("completion_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = details.get("cached_tokens")
            finally:
                if stream.first is not None:
                    self.streaming -= 1

    # -- an agent: its requests in order, sub-agent groups in parallel
    async def _agent(self, client, s: Session, entries: list[Entry], path: str, lane: int) -> None:
        turn = 0
        i = 0
        last = max((j for j, e in enumerate(entries) if isinstance(e, Request)), default=-1)
        while i < len(entries):
            if self.stopping.is_set():
                raise _Stop()
            e = entries[i]
            if isinstance(e, Subagent):
                group = []
                while i < len(entries) and isinstance(entries[i], Subagent):
                    sub = entries[i]
                    name = sub.agent_id or f"sa{i}"
                    group.append(
                        self._agent(
                            client, s, sub.requests, f"{path}/{name}" if path else name, lane
                        )
                    )
                    i += 1
                results = await asyncio.gather(*group, return_exceptions=True)
                for r in results:
                    if isinstance(r, BaseException):
                        raise r
                continue
            await self._think(e)
            await self._request(client, s, e, path, turn, lane, last=i == last)
            turn += 1
            i += 1

    async def _think(self, r: Request) -> None:
        wait = (r.think_time or 0.0) * self.cfg.think_scale
        if self.cfg.think_max is not None:
            wait = min(wait, self.cfg.think_max)
        if wait > 0:
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=wait)
                raise _Stop()
            except TimeoutError:
                pass

    async def _request(
        self, client, s: Session, r: Request, path: str, turn: int, lane: int, last: bool = False
    ) -> None:
        prompt = self.prompts[id(r)]
        max_tokens = max(1, r.out_tokens)
        if self.cfg.max_tokens_cap:
            max_tokens = min(max_tokens, self.cfg.max_tokens_cap)
        rec = RequestRecord(
            session=s.id,
            agent=path,
            turn=turn,
            lane=lane,
            start=0.0,
            trace_in=r.in_tokens,
            trace_out=r.out_tokens,
            max_tokens=max_tokens,
            expected_prompt_tokens=prompt.expected_prompt_tokens,
        )
        self.records.append(rec)
        key = f"{self.salt}:{s.id}:{path}" if path else f"{self.salt}:{s.id}"
        try:
            await self._call(client, rec, prompt, key, last)
        finally:
            if not rec.ok:
                self.failures += 1
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(fail=self.failures, refresh=False)

    async def _lane(self, client, lane: int, queue: asyncio.Queue) -> None:
        while not self.stopping.is_set():
            try:
                s = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                await self._agent(client, s, s.requests, "", lane)
                self.sessions_done += 1
            except _Stop:
                return

    async def run(self) -> ReplayResult:
        cfg = self.cfg
        queue: asyncio.Queue = asyncio.Queue()
        for s in self.sessions:
            queue.put_nowait(s)
        total = sum(1 for s in self.sessions for _ in s.iter_requests())
        if cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, unit="req", desc=f"replay c={cfg.concurrency}", dynamic_ncols=True
            )
        loop = asyncio.get_running_loop()
        interrupted = False
        tasks: list[asyncio.Task] = []

        def on_sigint() -> None:
            nonlocal interrupted
            interrupted = True
            self.stopping.set()
            for t in tasks:
                t.cancel()

        installed = False
        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
            installed = True
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        started_at = time.time()
        self.t0 = time.perf_counter()
        try:
            async with contextlib.AsyncExitStack() as stack:
                client = Spread(
                    [
                        await stack.enter_async_context(
                            httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)
                        )
                        for url in urls(cfg.url)
                    ]
                )
                tasks = [
                    asyncio.create_task(self._lane(client, i, queue))
                    for i in range(cfg.concurrency)
                ]
                watchdog = None
                if cfg.duration_s:

                    async def stop_later():
                        await asyncio.sleep(cfg.duration_s)
                        self.stopping.set()

                    watchdog = asyncio.create_task(stop_later())
                try:
                    results = await asyncio.gather(*tasks, return_exceptions=True)
                finally:
                    if watchdog:
                        watchdog.cancel()
                for r in results:
                    if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                        raise r
        finally:
            if installed:
                loop.remove_signal_handler(signal.SIGINT)
            if self.bar is not None:
                self.bar.close()
        ends = [r.start + r.e2e for r in self.records if r.e2e is not None]
        starts = [r.start for r in self.records]
        duration = (max(ends) - min(starts)) if ends else 0.0
        return ReplayResult(
            config=_config_json(cfg),
            records=self.records,
            started_at=started_at,
            duration_s=duration,
            interrupted=interrupted,
            salt=self.salt,
            sessions_done=self.sessions_done,
        )


class Spread:
    """Stands in for one ``httpx.AsyncClient``: each request goes to the next
    client in turn (per request, as ingress-nginx balances its upstreams); a
    refused connection is tried on the next client (nothing was sent yet), as
    ingress-nginx's ``proxy_next_upstream error`` does."""

    def __init__(self, clients: list[httpx.AsyncClient]) -> None:
        self._clients = clients
        self._turn = itertools.cycle(range(len(clients)))

    @contextlib.asynccontextmanager
    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        first = next(self._turn)
        order = self._clients[first:] + self._clients[:first]
        async with contextlib.AsyncExitStack() as stack:
            for client in order:
                try:
                    response = await stack.enter_async_context(client.stream(*args, **kwargs))
                    break
                except httpx.ConnectError:
                    if client is order[-1]:
                        raise
            yield response


def _config_json(cfg: ReplayConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d.pop("api_key", None)
    return d


def _error_message(text: str) -> str:
    try:
        obj = json.loads(text)
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        return str(err)[:300]
    except (json.JSONDecodeError, AttributeError):
        return text.strip()[:300]


def new_salt() -> str:
    return uuid.uuid4().hex[:12]


async def replay(
    cfg: ReplayConfig,
    sessions: list[Session],
    builder: PromptBuilder,
) -> ReplayResult:
    """Build every prompt (verified), then play the sessions."""
    prompts = build_prompts(sessions, builder)
    return await Replayer(cfg, sessions, prompts, salt=builder.salt).run()
