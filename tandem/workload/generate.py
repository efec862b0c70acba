"""Seeded synthetic agentic traces, and the statistics that describe a trace set.

The shape follows what the AgentX captures show for coding agents: many turns
per session; an input that grows each turn by the previous output plus new
tool results, so that each request re-uses almost all of the previous one as
its prefix (``reuse``, block-level); a prefix common to every session (tool
definitions and system prompt, ``shared_prefix`` tokens with global hash ids);
short outputs; think time between turns; and in a share of the sessions a
fan-out of sub-agents that fork the parent's context, run in parallel, and join
back (the parent's next turn carries their results).

The input grows geometrically (``in_next ~ carried / reuse``), which is what
keeps the per-turn reuse fraction near its parameter at any scale; a session
whose context would pass ``max_context`` is compacted (the context restarts at
the shared prefix plus a fresh summary, a cache miss), as agents do.

Two profiles: ``small`` (default: a few thousand tokens of context, tens of
sessions, short outputs -- what 2 CPU cores serve in minutes) and ``agentx``
(the published AgentX medians: 43 turns, 20K-token starts, ~100K+ contexts).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

from .metrics import percentile
from .trace import Request, Session, Subagent


@dataclass(frozen=True)
class GenParams:
    sessions: int = 12
    seed: int = 0
    block_size: int = 64
    turns_median: float = 8.0  # main-agent model calls per session
    turns_sigma: float = 0.5  # lognormal spread of the turn count
    turns_min: int = 2
    turns_max: int = 400
    shared_prefix: int = 512  # tokens common to all sessions (global ids)
    first_in_median: int = 1536  # first request's input, shared prefix included
    first_in_sigma: float = 0.25
    reuse: float = 0.96  # mean block-level prefix reuse vs the previous turn
    reuse_sigma: float = 0.5  # lognormal spread of the per-turn new fraction
    out_median: int = 24
    out_sigma: float = 0.5
    out_max: int = 128
    max_context: int = 3072  # compaction threshold (input + output)
    subagent_share: float = 0.44  # sessions that spawn sub-agents
    subagents_median: int = 4  # sub-agents per fan-out (1 + Poisson(median - 1))
    subagent_turns_median: float = 3.0
    subagent_task_median: int = 128  # new tokens a sub-agent adds to the forked context
    think_median: float = 0.5  # seconds between a response and the next request
    think_sigma: float = 0.8
    think_max: float = 5.0
    model: str = "agentx-synthetic"

    def validate(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"generator parameter {name}: {why}")

        need(self.sessions >= 1, "sessions", "must be >= 1")
        need(self.block_size >= 1, "block_size", "must be >= 1")
        need(0.0 < self.reuse < 1.0, "reuse", "must be in (0, 1)")
        need(0.0 <= self.subagent_share <= 1.0, "subagent_share", "must be in [0, 1]")
        need(
            self.turns_min >= 1 and self.turns_max >= self.turns_min,
            "turns_min/turns_max",
            "need 1 <= turns_min <= turns_max",
        )
        need(self.turns_median >= 1, "turns_median", "must be >= 1")
        need(self.subagents_median >= 1, "subagents_median", "must be >= 1")
        need(self.out_median >= 1 and self.out_max >= 1, "out_median/out_max", "must be >= 1")
        need(
            0 <= self.shared_prefix < self.first_in_median,
            "shared_prefix",
            "must be below first_in_median",
        )
        need(
            self.first_in_median + self.out_max < self.max_context,
            "max_context",
            "must exceed first_in_median + out_max",
        )
        need(
            self.think_median >= 0 and self.think_max >= 0, "think_median/think_max", "must be >= 0"
        )


PROFILES: dict[str, GenParams] = {
    "small": GenParams(),
    # Published AgentX medians (SemiAnalysis cc-traces): 43 turns, starts around
    # 20K tokens, grows past 100K, a few hundred output tokens, 44% of sessions
    # with sub-agents (median 4). Not servable on CPU; for statistics and GPUs.
    "agentx": GenParams(
        sessions=100,
        turns_median=43,
        turns_sigma=0.8,
        shared_prefix=14848,
        first_in_median=20160,
        first_in_sigma=0.5,
        out_median=300,
        out_sigma=0.9,
        out_max=4096,
        max_context=200_000,
        subagent_turns_median=8,
        subagent_task_median=2048,
        think_median=3.0,
        think_sigma=1.2,
        think_max=60.0,
    ),
}


def params_for(profile: str, **overrides: Any) -> GenParams:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose from {sorted(PROFILES)}")
    known = {f.name for f in fields(GenParams)}
    bad = set(overrides) - known
    if bad:
        raise ValueError(f"unknown generator parameter(s): {sorted(bad)}")
    p = replace(PROFILES[profile], **{k: v for k, v in overrides.items() if v is not None})
    p.validate()
    return p


class _Gen:
    def __init__(self, p: GenParams):
        self.p = p
        self.rng = np.random.default_rng(p.seed)
        self.bs = p.block_size
        self.shared_blocks = p.shared_prefix // p.block_size
        self.next_id = self.shared_blocks + 1  # ids 1..shared_blocks: the shared prefix

    # -- random draws
    def lognormal(self, median: float, sigma: float) -> float:
        return float(median * math.exp(sigma * self.rng.standard_normal()))

    def out_tokens(self) -> int:
        return int(
            min(self.p.out_max, max(1, round(self.lognormal(self.p.out_median, self.p.out_sigma))))
        )

    def think(self) -> float:
        if self.p.think_median <= 0:
            return 0.0
        return round(
            min(self.p.think_max, self.lognormal(self.p.think_median, self.p.think_sigma)), 3
        )

    def turn_reuse(self) -> float:
        # new fraction (1 - r) is lognormal with mean (1 - reuse)
        s = self.p.reuse_sigma
        new = (1.0 - self.p.reuse) * math.exp(s * self.rng.standard_normal() - s * s / 2)
        return min(0.995, max(0.3, 1.0 - new))

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def ids_for(self, carried: list[int], n_in: int) -> list[int]:
        n = math.ceil(n_in / self.bs)
        keep = carried[: min(len(carried), n_in // self.bs)]
        return keep + self.fresh(n - len(keep))

    @staticmethod
    def api_time(new_tokens: int, out: int) -> float:
        # a nominal server (for the t field only; replay uses think_time)
        return round(0.05 + new_tokens * 1e-4 + out * 0.02, 3)

    # -- one agent (main or sub-agent)
    def agent(
        self,
        sid: str,
        n_turns: int,
        carried: list[int],
        first_in: int,
        t0: float,
        spawn_at: int | None,
    ) -> tuple[list, float]:
        entries: list = []
        t = t0
        n_in = first_in
        prev_in = prev_out = 0  # the previous turn's, set at the end of each turn
        prev_full: list[int] = []
        pending_join_tokens = 0
        for k in range(n_turns):
            if k > 0:
                # the previous output and new tool results are appended
                r = self.turn_reuse()
                base = len(prev_full) * self.bs
                grow_min = prev_out + 1 + pending_join_tokens
                n_in = max(prev_in + grow_min, math.ceil(base / r))
                carried = prev_full
                pending_join_tokens = 0
                if n_in + self.p.out_max > self.p.max_context:  # compaction
                    carried = list(range(1, self.shared_blocks + 1))
                    n_in = min(self.p.first_in_median, self.p.max_context - self.p.out_max - 1)
            think = 0.0 if k == 0 else self.think()
            t += think
            ids = self.ids_for(carried, n_in)
            out = self.out_tokens()
            new_tokens = n_in - len(carried[: n_in // self.bs]) * self.bs
            api = self.api_time(new_tokens, out)
            entries.append(
                Request(
                    t=round(t, 3),
                    in_tokens=n_in,
                    out_tokens=out,
                    hash_ids=ids,
                    type="s",
                    think_time=think,
                    api_time=api,
                    extra={"model": self.p.model},
                )
            )
            t += api
            prev_in, prev_out, prev_full = n_in, out, ids[: n_in // self.bs]
            if spawn_at is not None and k == spawn_at:
                subs, t_end, join_tokens = self.fan_out(sid, prev_full, t)
                entries.extend(subs)
                t = t_end
                pending_join_tokens = join_tokens
        return entries, t

    def fan_out(self, sid: str, parent_full: list[int], t: float):
        p = self.p
        n_sub = 1 + int(self.rng.poisson(p.subagents_median - 1))
        subs, ends, join = [], [t], 0
        for j in range(n_sub):
            turns = max(1, round(self.lognormal(p.subagent_turns_median, 0.4)))
            task = max(1, round(self.lognormal(p.subagent_task_median, 0.3)))
            first_in = len(parent_full) * self.bs + task
            if first_in + p.out_max > p.max_context:
                first_in = p.max_context - p.out_max - 1
            reqs, t_end = self.agent(sid, turns, parent_full, first_in, t, None)
            subs.append(Subagent(requests=reqs, agent_id=f"sa{j + 1}", t=round(t, 3)))
            ends.append(t_end)
            join += reqs[-1].out_tokens
        return subs, max(ends), join

    def session(self, i: int) -> Session:
        p = self.p
        sid = f"s{p.seed:04d}-{i:05d}"
        turns = int(
            min(p.turns_max, max(p.turns_min, round(self.lognormal(p.turns_median, p.turns_sigma))))
        )
        first_in = int(
            max(p.shared_prefix + 1, round(self.lognormal(p.first_in_median, p.first_in_sigma)))
        )
        first_in = min(first_in, p.max_context - p.out_max - 1)
        spawn_at = None
        if turns >= 2 and self.rng.random() < p.subagent_share:
            spawn_at = int(self.rng.integers(0, turns - 1))  # a later parent turn joins
        shared = list(range(1, self.shared_blocks + 1))
        entries, _ = self.agent(sid, turns, shared, first_in, 0.0, spawn_at)
        return Session(
            id=sid,
            block_size=self.bs,
            requests=entries,
            hash_id_scope="global",
            models=[p.model],
            extra={"generator": {"seed": p.seed, "index": i}},
        )


def generate(p: GenParams) -> list[Session]:
    """A list of sessions; the same parameters always give the same sessions."""
    p.validate()
    g = _Gen(p)
    return [g.session(i) for i in range(p.sessions)]


# ------------------------------------------------------------------ statistics


def _agents(entries, out: list[list[Request]]) -> None:
    own = [e for e in entries if isinstance(e, Request)]
    out.append(own)
    for e in entries:
        if isinstance(e, Subagent):
            _agents(e.requests, out)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reuse_bound(sessions: list[Session], engine_block_size: int | None = None) -> float:
    """Token share of all input that an unbounded prefix cache could serve
    (full blocks whose whole prefix chain appeared in an earlier request, in
    trace order, capped at in - 1 like vLLM): the hit-rate ceiling of a trace.
    With ``engine_block_size``, the shared prefix is rounded down to the
    engine's blocks (the replay's prompts put trace block i at the same
    token offsets, so an engine caches whole engine blocks of it)."""
    seen: set[tuple] = set()
    hit = total = 0
    for s in sessions:
        scope = () if s.hash_id_scope == "global" else (s.id,)
        for _, _, r in s.iter_requests():
            full = min(r.in_tokens // s.block_size, (r.in_tokens - 1) // s.block_size)
            chain: tuple = scope
            n_hit, counting = 0, True
            chains = []
            for h in r.hash_ids[:full]:
                chain = (hash(chain), h)
                chains.append(chain)
                if counting and chain in seen:
                    n_hit += 1
                else:
                    counting = False
            seen.update(chains)
            shared = n_hit * s.block_size
            if engine_block_size:
                shared = min(shared, r.in_tokens - 1) // engine_block_size * engine_block_size
            hit += shared
            total += r.in_tokens
    return hit / total if total else 0.0


def generated_trace(profile: str, **overrides: Any) -> tuple[list[Session], dict[str, Any]]:
    """Sessions of a generated profile and the trace description reports
    carry (where they came from, the parameters, the shape statistics)."""
    p = params_for(profile, **overrides)
    sessions = generate(p)
    return sessions, {
        "path": f"<generated profile={profile} seed={p.seed}>",
        "params": params_dict(p),
        "stats": trace_stats(sessions),
    }


def trace_stats(sessions: list[Session]) -> dict[str, Any]:
    """Shape statistics of a trace set (what the generator's parameters set)."""
    turns, fanouts, reuses, ins, outs, thinks = [], [], [], [], [], []
    spawning = 0
    n_requests = 0
    for s in sessions:
        main = [e for e in s.requests if isinstance(e, Request)]
        turns.append(len(main))
        groups, run = [], 0
        for e in s.requests:
            if isinstance(e, Subagent):
                run += 1
            elif run:
                groups.append(run)
                run = 0
        if run:
            groups.append(run)
        if groups:
            spawning += 1
            fanouts.extend(groups)
        agents: list[list[Request]] = []
        _agents(s.requests, agents)
        for reqs in agents:
            for prev, cur in zip(reqs, reqs[1:]):
                shared = _common_prefix(
                    prev.hash_ids[: prev.in_tokens // s.block_size], cur.hash_ids
                )
                reuses.append(shared * s.block_size / cur.in_tokens)
        for _, _, r in s.iter_requests():
            n_requests += 1
            ins.append(r.in_tokens)
            outs.append(r.out_tokens)
            if r.think_time:
                thinks.append(r.think_time)

    def pct(xs, q):
        return percentile(xs, q) or 0.0

    return {
        "sessions": len(sessions),
        "requests": n_requests,
        "turns_median": statistics.median(turns) if turns else 0,
        "turns_mean": statistics.fmean(turns) if turns else 0,
        "subagent_share": spawning / len(sessions) if sessions else 0.0,
        "subagents_per_fanout_median": statistics.median(fanouts) if fanouts else 0,
        "fanouts": len(fanouts),
        "reuse_mean": statistics.fmean(reuses) if reuses else 0.0,
        "reuse_median": statistics.median(reuses) if reuses else 0.0,
        "reuse_bound": reuse_bound(sessions),
        "reuse_bound_engine128": reuse_bound(sessions, 128),
        "in_p50": pct(ins, 50),
        "in_p99": pct(ins, 99),
        "in_max": max(ins, default=0),
        "out_p50": pct(outs, 50),
        "out_max": max(outs, default=0),
        "think_p50": pct(thinks, 50),
        "total_in_tokens": int(sum(ins)),
        "total_out_tokens": int(sum(outs)),
    }


def params_dict(p: GenParams) -> dict[str, Any]:
    return asdict(p)
