"""The simulator (sim/): its event core, cost models against their profiles,
the KV cache's eviction, the routing core in the loop, a Ray sweep and the
CLI. No mocks: the real routing core, the real trace generator, a real local
Ray."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest

from operators.planner.profiles import EngineConfig, EngineProfile, ProfilePoint
from services.router.routing.hashing import BlockHasher
from sim.cli import main as sim_main
from sim.cluster import ClusterConfig, MissLedger, Simulation, Traffic, prompt_blocks
from sim.costs import DEFAULT_STEP_SHARE, StepModel, StoreTier, fit_decode, fit_prefill
from sim.defaults import (
    CPU_BLOCK_BYTES_PER_TOKEN,
    CPU_PROFILES,
    PROFILES,
    fitted_model,
    load_profiles,
)
from sim.engine import Engine, EngineSettings, Job, KVCache
from sim.events import EventLoop
from sim.sweep import grid, model_fields, run_on_ray, run_point
from tandem.workload.generate import generate as generate_trace
from tandem.workload.generate import params_for
from tandem.workload.trace import Request, Session

# ----------------------------------------------------------------- event core


def test_events_run_in_time_order_and_ties_in_schedule_order():
    loop = EventLoop()
    seen = []
    for t, tag in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b")]:
        loop.at(t, lambda tag=tag: seen.append((loop.now, tag)))
    loop.after(0.5, lambda: loop.after(1.5, lambda: seen.append((loop.now, "e"))))
    loop.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (2.0, "c"), (2.0, "d"), (2.0, "e")]
    with pytest.raises(ValueError, match="past"):
        loop.at(1.0, lambda: None)


def test_run_stops_at_until():
    loop = EventLoop()
    seen = []
    loop.at(1.0, lambda: seen.append(1))
    loop.at(3.0, lambda: seen.append(3))
    loop.run(until=2.0)
    assert seen == [1] and loop.now == 2.0 and len(loop) == 1


def _small(policy="cost", kv_blocks=24, **kw):
    return ClusterConfig(
        policy=policy,
        engine=EngineSettings(kv_blocks=kv_blocks, block_bytes=128 * CPU_BLOCK_BYTES_PER_TOKEN),
        model=fitted_model(),
        **kw,
    )


def test_a_simulation_is_a_function_of_its_seed():
    def run(seed):
        sim = Simulation(_small(), Traffic(seed=seed))
        sim.run()
        return [(r.session, r.arrival, r.first_token, r.end, r.decode_pod) for r in sim.records]

    first = run(0)
    assert first == run(0)
    assert first != run(1)


# ---------------------------------------------------------------- cost models


def _profile(role, points, gpus=1):
    config = EngineConfig(name=f"p-{role}", role=role, model="m", gpus_per_replica=gpus)
    return EngineProfile(config=config, points=tuple(points), source="published")


def _point(concurrency, rate, isl, osl, hit=0.0, itl=None):
    return ProfilePoint(
        concurrency=concurrency,
        request_rate=rate,
        input_tokens_per_s=rate * isl,
        output_tokens_per_s=rate * osl,
        ttft_p50_s=None,
        ttft_p90_s=None,
        hit_rate=hit,
        in_flight=concurrency,
        itl_s=itl,
    )


def test_prefill_fit_reproduces_the_profiles_throughput():
    """At the profile's mean request (cached prefix, then the uncached part)
    the model computes the profile's uncached tokens per second."""
    prof = _profile("prefill", [_point(1, 0.5, 4000, 1, hit=0.5), _point(4, 1.0, 4000, 1, 0.5)])
    model = fit_prefill(prof)
    assert model.prefill_s(2000, 2000) == pytest.approx(2000 / 2000.0)  # 1 req/s x 2000 uncached
    # the context-dependent part: a token deep in a long context costs more
    assert model.prefill_s(100, 8000) > model.prefill_s(100, 0)
    assert fit_prefill(prof, ctx_share=0.0).prefill_s(100, 8000) == pytest.approx(0.05)


def test_decode_fit_recovers_step_and_per_sequence_cost():
    # ITL = 10 ms + 2 ms per sequence in the step
    points = [
        _point(b, b / (0.01 + 0.002 * b) / 100, 1000, 100, itl=0.01 + 0.002 * b) for b in (1, 4, 16)
    ]
    model = fit_decode(_profile("decode", points))
    assert model.step_s == pytest.approx(0.01)
    sat = max(points, key=lambda p: p.request_rate)
    context = 8 * (sat.mean_input_tokens + sat.mean_output_tokens / 2)
    assert model.step([], 8, int(context)) == pytest.approx(0.01 + 0.016, rel=1e-6)


def test_shipped_cpu_profiles_fit_their_figures():
    profiles = load_profiles(CPU_PROFILES)
    model = fitted_model(CPU_PROFILES, gpus_per_pod=1)
    # the prefill note: a cold 1562-token prompt in 5.98 s on one core
    assert model.prefill_s(1562, 0) == pytest.approx(5.98, rel=0.01)
    # the decode note: 16 sequences at 365 tokens/s on 2 cores -> twice the step on 1
    d = profiles["decode"].points[0]
    context = 16 * (d.mean_input_tokens + d.mean_output_tokens / 2)
    assert model.step([], 16, int(context)) == pytest.approx(2 * 16 / 365.0, rel=0.01)
    # one load level: the step's fixed share is a parameter, a batch of one pays it
    assert model.step([], 1, int(context / 16)) == pytest.approx(
        2 * 16 / 365.0 * (DEFAULT_STEP_SHARE + (1 - DEFAULT_STEP_SHARE) / 16), rel=0.01
    )


def test_published_gpu_profiles_fit():
    """operators/planner/published: DeepSeek-V3 on H800 (figures marked published)."""
    published = (
        PROFILES.parents[1] / "operators" / "planner" / "published" / "deepseek-v3-h800.yaml"
    )
    profiles = load_profiles(published)
    p = profiles["prefill"].points[0]
    model = fit_prefill(profiles["prefill"])
    uncached = p.mean_uncached_tokens
    start = p.mean_input_tokens - uncached
    assert model.prefill_s(int(uncached), int(start)) == pytest.approx(
        int(uncached) / p.uncached_tokens_per_s, rel=0.01
    )


PUBLISHED = PROFILES.parents[1] / "operators" / "planner" / "published" / "deepseek-v3-h800.yaml"


def test_the_published_decode_curve_fits_at_every_point_and_every_pod_size():
    """The decode profile's points (one published, the rest from the model its
    note states) are one fixed cost per step plus one cost per sequence: the fit
    goes through each. The profile runs data-parallel ranks of one GPU, so a
    pod of 8 GPUs is 8 ranks: the same step at the same requests per GPU."""
    decode = load_profiles(PUBLISHED)["decode"]
    assert len(decode.points) >= 4
    unit = decode.config.gpus_per_replica
    for gpus in (unit, 8, 1):
        model = fitted_model(PUBLISHED, gpus_per_pod=gpus)
        for pt in decode.points:
            assert pt.in_flight is not None and pt.itl_s is not None
            batch = pt.in_flight * gpus / unit
            context = batch * (pt.mean_input_tokens + pt.mean_output_tokens / 2)
            assert model.decode_s(round(batch), round(context)) + model.step_s == pytest.approx(
                pt.itl_s, rel=0.01 if batch >= 50 else 0.05
            )
    # the fixed share is the note's assumption: 0.465 of the published step
    published = decode.points[-1]
    assert published.itl_s is not None
    assert fitted_model(PUBLISHED, 8).step_s == pytest.approx(0.465 * published.itl_s, rel=1e-3)


def test_a_data_parallel_profile_scales_in_ranks_not_in_speed():
    from sim.defaults import scaled_profile

    decode = load_profiles(PUBLISHED)["decode"]
    pod = scaled_profile(decode, 8)
    k = 8 / decode.config.gpus_per_replica
    for a, b in zip(decode.points, pod.points):
        assert b.request_rate == pytest.approx(a.request_rate * k)
        assert b.itl_s == pytest.approx(a.itl_s)
        assert b.in_flight == pytest.approx((a.in_flight or 0) * k)


def _trace_tokens(session: Session, index: int, r: Request) -> list[int]:
    """A prompt's token ids as the trace's blocks make them: the trace id's
    ``block_size`` tokens, local ids private to their session."""
    bs = session.block_size
    scope = 0 if session.hash_id_scope == "global" else (index + 1) << 20
    out: list[int] = []
    for i, h in enumerate(r.hash_ids):
        base = (scope + h) * bs
        out.extend(range(base, base + min(bs, r.in_tokens - i * bs)))
    return out


@pytest.mark.parametrize(("scope", "engine_block"), [("global", 16), ("local", 64), ("local", 24)])
def test_the_simulated_block_hashes_tell_blocks_apart_as_the_router_hashes_tokens(
    scope: str, engine_block: int
):
    """``prompt_blocks`` hands the routing core block hashes instead of token
    ids: over a trace's prompts (sessions sharing a prefix, turns growing,
    sub-agents forking) two blocks get the same hash exactly when the router's
    own hasher, hashing the token ids, gives them the same hash; for engine
    blocks equal to, a multiple of, and not a multiple of the trace's."""
    sessions = [
        replace(s, hash_id_scope=scope)
        for s in generate_trace(params_for("small", sessions=4, seed=3, block_size=16))
    ]
    hasher = BlockHasher(engine_block)
    ours: list[int] = []
    theirs: list[int] = []
    for index, s in enumerate(sessions):
        for _, _, r in s.iter_requests():
            n, hashes = prompt_blocks(s, index, r, engine_block)
            tokens = _trace_tokens(s, index, r)
            assert n == len(tokens)
            ours += hashes
            theirs += hasher.event_hashes(tokens)
    assert len(ours) == len(theirs) > 100

    def partition(hs: list[int]) -> list[int]:
        first: dict[int, int] = {}
        return [first.setdefault(h, i) for i, h in enumerate(hs)]

    assert partition(ours) == partition(theirs)
    assert len(set(ours)) < len(ours)  # the trace reuses blocks: the check has teeth


# ------------------------------------------------------------------ KV cache


def test_kv_cache_evicts_the_least_recently_freed_block_tail_first():
    kv = KVCache(4)
    assert kv.acquire([], 2) == []
    assert kv.register([11, 12], owned=2) == [11, 12]
    kv.release([11, 12], 0)  # both free, cached; 12 (the tail) first in line
    assert kv.match([11, 12, 13], cap=3) == 2
    assert kv.acquire([], 3) == [12]  # one block had to go
    assert kv.match([11, 12], cap=2) == 1
    assert kv.can_allocate([], 1)  # by evicting 11
    assert not kv.can_allocate([], 2)  # 3 in use
    kv.release([], 3)
    assert kv.can_allocate([11], 3)  # reusing 11, and 3 new blocks
    assert kv.acquire([11], 3) == [] and kv.used() == 4


# ------------------------------------------------ the routing core in the loop


def test_the_routing_policy_decides_placements():
    runs = {}
    for policy in ("cost", "round-robin"):
        sim = Simulation(_small(policy, kv_blocks=8192), Traffic())
        summary = sim.run()
        runs[policy] = (summary, [r.decode_pod for r in sim.records], sim)
    assert runs["cost"][1] != runs["round-robin"][1]
    # round robin alternates pods in arrival order; cost keeps sessions where their KV is
    assert {r.reason for r in runs["round-robin"][2].records} == {"round-robin"}
    assert runs["cost"][0]["hit_rate"] > runs["round-robin"][0]["hit_rate"]


def test_the_consistent_hash_baseline_keeps_every_agent_on_its_ring_home():
    from services.router.routing.hashring import ring_home

    sim = Simulation(_small("consistent-hash", kv_blocks=8192, aggregated=4), Traffic(sessions=8))
    sim.run()
    pods = sorted(sim.engines)
    assert {r.reason for r in sim.records} == {"hash"}
    assert all(r.decode_pod == ring_home(r.session, pods) for r in sim.records)
    assert len({r.decode_pod for r in sim.records}) > 1


def test_engines_kv_events_reach_the_prefix_index():
    sim = Simulation(_small(kv_blocks=24), Traffic())
    sim.run()
    index = sim.core.index
    for name, engine in sim.engines.items():
        cached = len(engine.kv.in_use) + len(engine.kv.free_cached)
        assert index.held_blocks(name) == cached > 0  # stored less removed, as the engine holds


def test_p_d_runs_prefill_pods_above_the_threshold_only():
    config = replace(_small(kv_blocks=8192), aggregated=0, prefill=1, decode=1)
    sim = Simulation(config, Traffic())
    sim.run()
    remote = [r for r in sim.records if r.prefill_pod]
    local = [r for r in sim.records if not r.prefill_pod]
    assert remote and local
    assert all(r.prompt_tokens - r.cached_tokens >= 256 for r in remote)


def test_the_miss_ledger_tells_new_evicted_and_elsewhere_blocks_apart():
    ledger = MissLedger(block_size=4)
    here, there = KVCache(8), KVCache(8)
    there.acquire([], 2)
    ledger.stored(there.register([1, 2], owned=2))  # 1, 2 cached on the other pod
    here.acquire([], 1)
    ledger.stored(here.register([3], owned=1))
    here.release([3], 0)
    ledger.removed(here.acquire([], 8))  # 3 evicted from the only pod that had it
    # a prompt of 4 full blocks and 2 tokens, nothing reused: 1, 2 elsewhere, 3 evicted, 4 new
    assert ledger.reasons([1, 2, 3, 4], 18, 0, here) == {
        "new": 4,
        "evicted": 4,
        "elsewhere": 8,
        "tail": 2,
    }
    # two blocks reused; a prompt of whole blocks computes its last block every time
    assert ledger.reasons([1, 2, 3, 4], 16, 2, here) == {
        "new": 0,
        "evicted": 4,
        "elsewhere": 0,
        "tail": 4,
    }


@pytest.mark.parametrize("policy", ["cost", "round-robin"])
def test_miss_reasons_account_for_every_computed_token(policy):
    config = replace(_small(policy, kv_blocks=24), miss_reasons=True)
    sim = Simulation(config, Traffic(sessions=8))
    summary = sim.run()
    for r in sim.records:
        assert r.missed is not None and sum(r.missed.values()) == r.prompt_tokens - r.cached_tokens
    # nothing was cached before the trace's first request
    assert sim.records[0].missed["evicted"] == sim.records[0].missed["elsewhere"] == 0
    misses = summary["miss_tokens"]
    prompt = sum(r.prompt_tokens for r in sim.records)
    assert sum(misses.values()) == round(prompt * (1 - summary["hit_rate"]))
    assert misses["new"] > 0 and misses["evicted"] > 0  # 24 blocks a pod: KV pressure
    if policy == "round-robin":  # sessions move every turn
        assert misses["elsewhere"] > 0 and summary["moved_requests"] > 0
    assert all(summary["miss_tokens_moved"][k] <= misses[k] for k in misses)
    assert "miss_tokens" not in Simulation(_small(policy), Traffic(sessions=2)).run()


# -------------------------------------------------------------------- sweeps


def _point_dict(**kw):
    base = {
        "model": model_fields(fitted_model()),
        "gpus_per_pod": 1,
        "block_size": 128,
        "block_bytes": 128 * CPU_BLOCK_BYTES_PER_TOKEN,
        "max_num_batched_tokens": 2048,
        "long_prefill_threshold": 0,
        "link_gbps": 5.0,
        "link_latency_ms": 1.0,
        "store_gbps": 1.0,
        "store_latency_ms": 2.0,
        "remote_prefill_threshold": 256,
        "trace_profile": "small",
        "turns_median": 4.0,
        "think_scale": 0.2,
        "concurrency": 4,
        "pods": "2",
        "kv_blocks": 24,
        "store_blocks": 0,
        "sessions": 4,
        "seed": 0,
    }
    return grid(base, **kw)


def test_a_two_task_sweep_on_ray_matches_the_runs_in_process(monkeypatch, tmp_path):
    # ray.init writes ~/.ray/auth_token, and every later `ray start` on the
    # machine then turns token authentication on (tests/operators/test_ray_group).
    monkeypatch.setenv("HOME", str(tmp_path))
    points = _point_dict(policy=["cost", "round-robin"])
    rows = run_on_ray(points, num_cpus=2)
    assert [r["policy"] for r in rows] == ["cost", "round-robin"]
    for row, point in zip(rows, points):
        local = run_point(point)
        assert {k: v for k, v in row.items() if k != "wall_s"} == {
            k: v for k, v in local.items() if k != "wall_s"
        }


def test_cli_run_prints_a_row_and_refuses_bad_pods(capsys):
    assert sim_main(["run", "--pods", "1P1D", "--kv-blocks", "64", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["pods"] == "1P1D" and row["requests"] == 43
    with pytest.raises(SystemExit) as exc:
        sim_main(["run", "--pods", "2X"])
    assert exc.value.code == 2
    assert "xPyD" in capsys.readouterr().err


def test_cli_run_charges_shared_cores_to_prompt_steps(capsys):
    rows = []
    for flags in ([], ["--shared-core-s", "0.5"]):
        assert sim_main(["run", "--kv-blocks", "64", "--json", *flags]) == 0
        rows.append(json.loads(capsys.readouterr().out))
    plain, shared = rows
    assert shared["requests"] == plain["requests"]
    assert shared["ttft_p50_s"] >= plain["ttft_p50_s"] + 0.5


def test_a_request_that_cannot_grow_preempts_the_newest_and_it_recomputes():
    """vLLM's recompute preemption: with 4 blocks of 4 tokens, two requests of
    6-token prompts and 6 output tokens cannot both finish in KV; the newer
    one is preempted, waits, and computes its prompt again."""
    loop = EventLoop()
    stored, removed = [], []
    engine = Engine(
        "pod",
        EngineSettings(kv_blocks=4, block_size=4, max_num_batched_tokens=64),
        StepModel(step_s=0.01, token_s=0.001, seq_s=0.001),
        loop,
        lambda pod, hs: stored.extend(hs),
        lambda pod, hs: removed.extend(hs),
    )
    done = []
    jobs = [Job(6, [10 + i], 6, on_done=lambda j: done.append((j, loop.now))) for i in range(2)]
    for job in jobs:
        engine.submit(job)
    loop.run()
    assert [j for j, _ in done] == jobs
    assert jobs[0].preemptions == 0 and jobs[1].preemptions == 1
    assert engine.kv.used() == 0 and sorted(stored) == [10, 11]


def _engine(kv_blocks, stored=None, budget=64):
    loop = EventLoop()
    engine = Engine(
        "pod",
        EngineSettings(kv_blocks=kv_blocks, block_size=4, max_num_batched_tokens=budget),
        StepModel(step_s=0.01, token_s=0.001, seq_s=0.001),
        loop,
        lambda pod, hs: (stored if stored is not None else []).extend(hs),
        lambda pod, hs: None,
    )
    return loop, engine


def test_blocks_are_cached_when_scheduled_so_a_request_in_the_same_step_reuses_them():
    """vLLM's allocate_slots caches a chunk's full blocks as it schedules it:
    a second request with the same 3-block prefix, admitted in the same step,
    reuses them (one copy in KV, its prefix counted cached); the KV events
    come when the step ends."""
    stored: list[int] = []
    loop, engine = _engine(kv_blocks=16, stored=stored)
    engine.submit(Job(2, [], 2))  # its step runs while the two arrive
    first = Job(14, [1, 2, 3], 2)
    second = Job(14, [1, 2, 3], 2)
    engine.submit(first)
    engine.submit(second)
    loop.run(until=0.02)  # the first step ended at 0.012: the next one took both
    assert engine.running[1:] == [first, second]
    assert second.cached_tokens == 12 and second.held == [1, 2, 3]
    assert engine.kv.used() == 1 + 3 + 1 + 1 and stored == []
    loop.run()
    assert stored == [1, 2, 3]
    assert first.finished and second.finished and engine.kv.used() == 0


def test_a_duplicate_block_stays_anonymous_and_the_blocks_after_it_are_cached():
    kv = KVCache(8)
    kv.acquire([], 1)
    assert kv.register([2], owned=1) == [2]
    kv.acquire([], 3)
    assert kv.register([1, 2, 3], owned=3) == [1, 3]  # 2 is cached already
    assert kv.used() == 4 and kv.anonymous == 1


def test_a_request_waits_until_its_whole_prompt_fits():
    """vLLM's scheduler_reserve_full_isl: a 4-block prompt is admitted only
    when all 4 blocks are free, though with a budget of 4 tokens a step its
    first chunk would need one."""
    loop, engine = _engine(kv_blocks=6, budget=4)
    running = Job(8, [1, 2], 3)
    engine.submit(running)
    waiting = Job(16, [11, 12, 13, 14], 1)
    engine.submit(waiting)
    # steps 1-2 compute the running prompt; in step 3 (0.028-0.039) it
    # decodes in 3 blocks and the step has 3 tokens to spare
    loop.run(until=0.035)
    assert list(engine.waiting) == [waiting] and engine.kv.used() == 3
    loop.run()
    assert waiting.finished and running.finished


def _played(config, traffic):
    """Everything a run shows: its figures, each request's record, what the
    engines did and every KV event the router's index got, in order."""
    sim = Simulation(config, traffic)
    events = []
    for replica, core in enumerate(sim.cores):
        index = core.index
        stored, removed = index.stored, index.removed

        def record(kind, apply, replica=replica):
            def call(pod, hashes):
                events.append((replica, kind, sim.loop.now, pod, list(hashes)))
                apply(pod, hashes)

            return call

        index.stored, index.removed = record("stored", stored), record("removed", removed)
    summary = {k: v for k, v in sim.run().items() if k not in ("wall_s", "events")}
    engines = {
        n: (e.busy_s, e.steps, e.kv.used(), list(e.kv.free_cached)) for n, e in sim.engines.items()
    }
    return summary, [vars(r) for r in sim.records], engines, events


@pytest.mark.parametrize(
    "config, traffic",
    [
        (_small(kv_blocks=24), Traffic()),  # KV-bound: evictions and preemptions
        (_small(kv_blocks=8192, aggregated=4), Traffic(sessions=12, concurrency=0)),
        (
            replace(_small(kv_blocks=64), aggregated=0, prefill=1, decode=2),
            Traffic(sessions=8, concurrency=0),
        ),
        (
            _small("round-robin", kv_blocks=25, aggregated=4, store=StoreTier(20, 1e9, 0.002)),
            Traffic(sessions=16, concurrency=0),
        ),
        (
            replace(
                _small(kv_blocks=24),
                engine=replace(_small(kv_blocks=24).engine, async_scheduling=False),
            ),
            Traffic(),
        ),
    ],
    ids=["tight-kv", "ample-kv", "p-d", "store", "synchronous"],
)
def test_decode_runs_change_nothing_but_the_work(config, traffic, monkeypatch):
    """Batches of only decodes stepped as runs give the step-by-step engine's
    run exactly: every figure, record, step and KV event at the same time."""
    plans = []
    plan = Engine._plan
    monkeypatch.setattr(Engine, "_plan", lambda self, now: plans.append(1) or plan(self, now))
    step_by_step = _played(replace(config, decode_runs=False), traffic)
    planned_each_step = len(plans)
    plans.clear()
    assert _played(config, traffic) == step_by_step
    assert len(plans) < planned_each_step  # some steps were a run's


def _decoding_engine(kv_blocks, decode_runs, kv_log=None):
    """One engine of 4-token blocks whose decode cost grows with context;
    its KV events go to ``kv_log`` when given."""
    loop = EventLoop()

    def logged(kind):
        return lambda pod, hs: kv_log is not None and kv_log.append((kind, loop.now, list(hs)))

    engine = Engine(
        "pod",
        EngineSettings(kv_blocks=kv_blocks, block_size=4, max_num_batched_tokens=64),
        StepModel(step_s=0.01, token_s=0.001, seq_s=0.001, seq_ctx_s=1e-5),
        loop,
        logged("stored"),
        logged("removed"),
        decode_runs=decode_runs,
    )
    return loop, engine


def test_a_decode_run_ends_where_blocks_do_not_fit_or_a_request_arrives():
    """One engine, 4-token blocks: decode runs cross block boundaries,
    evict cached blocks, end at a preemption and at arrivals mid-run; the
    times, KV events and preemptions are the step-by-step engine's."""

    def play(decode_runs):
        log = []
        loop, engine = _decoding_engine(14, decode_runs, log)
        jobs = [
            Job(9, [100 + i, 200 + i], out, on_done=lambda j: log.append(("done", loop.now)))
            for i, out in enumerate([30, 7, 19, 12, 25])
        ]
        for i, job in enumerate(jobs):
            loop.at(0.05 * i * i, lambda job=job: engine.submit(job))
        loop.run()
        return log, [j.preemptions for j in jobs], engine.steps, engine.busy_s

    runs = play(True)
    assert runs == play(False)
    assert sum(runs[1]) > 0 and any(kind == "removed" for kind, *_ in runs[0])


def _plain_engine(decode_runs, **settings):
    """One engine of 40 4-token blocks whose steps cost no context."""
    loop = EventLoop()
    engine = Engine(
        "pod",
        EngineSettings(kv_blocks=40, block_size=4, max_num_batched_tokens=64, **settings),
        StepModel(step_s=0.01, token_s=0.001, seq_s=0.001),
        loop,
        lambda pod, hs: None,
        lambda pod, hs: None,
        decode_runs=decode_runs,
    )
    return loop, engine


@pytest.mark.parametrize("decode_runs", [True, False])
def test_asynchronous_scheduling_puts_an_arrival_during_a_step_into_the_step_after_next(
    decode_runs,
):
    """vLLM plans a busy engine's next step as the current one starts: a
    request arriving mid-step is first scheduled one step later than with
    synchronous scheduling; on an idle engine it starts at once either way."""

    def first_token_at(async_scheduling, arrival):
        loop, engine = _plain_engine(decode_runs, async_scheduling=async_scheduling)
        seen = {}
        engine.submit(Job(8, [1, 2], 20, on_first_token=lambda j: seen.setdefault("busy", 0)))
        late = Job(8, [3, 4], 2, on_first_token=lambda j: seen.setdefault("late", loop.now))
        loop.at(arrival, lambda: engine.submit(late))
        loop.run()
        return seen["late"]

    # The first request's prompt step ends at 0.018 s, then decode steps of 0.011 s.
    mid_step = 0.025
    step = 0.011
    sync, asynchronous = first_token_at(False, mid_step), first_token_at(True, mid_step)
    assert asynchronous == pytest.approx(sync + step)
    alone = 1.0  # the first request has ended: the engine is idle
    assert first_token_at(True, alone) == pytest.approx(first_token_at(False, alone))


def test_the_first_text_comes_with_the_visible_token_in_runs_and_step_by_step():
    """A request whose first tokens show no text: its ``on_visible`` comes at
    the end of the step that computed token ``visible_index``, the same in
    decode runs as step by step; a lone request's is its prompt step plus
    that many decode steps."""

    def play(decode_runs, visible):
        log = []
        loop, engine = _decoding_engine(40, decode_runs)
        jobs = [
            Job(
                9,
                [100 + i, 200 + i],
                out,
                on_first_token=lambda j, i=i: log.append(("first", i, loop.now)),
                on_visible=lambda j, i=i: log.append(("visible", i, loop.now)),
                on_done=lambda j, i=i: log.append(("done", i, loop.now)),
                visible_index=k,
            )
            for i, (out, k) in enumerate(zip([30, 7, 19], visible))
        ]
        for i, job in enumerate(jobs):
            loop.at(0.2 * i, lambda job=job: engine.submit(job))
        loop.run()
        return log

    shown = play(True, [3, 0, 6])
    assert shown == play(False, [3, 0, 6])
    at = {(kind, i): t for kind, i, t in shown}
    assert at["visible", 1] == at["first", 1]
    assert at["first", 0] < at["visible", 0] < at["done", 0]
    # Alone on the engine: the prompt step, then three decode steps of one sequence.
    first = play(True, [0, 0, 0])
    assert at["visible", 0] == pytest.approx(
        next(t for kind, i, t in first if (kind, i) == ("visible", 0))
        + sum(0.01 + 0.001 + 1e-5 * (9 + n) for n in range(3))
    )


def test_a_runs_first_visible_tokens_delay_its_ttft():
    """``Traffic.first_visible`` (per session, each request's first token with
    text) moves the simulated TTFT to that token; indices are checked against
    the trace."""
    traffic = Traffic()
    sessions = traffic.generate()
    every_third = tuple((s.id, tuple(2 for _ in s.iter_requests())) for s in sessions)
    plain = Simulation(_small(kv_blocks=182), traffic).run()
    later = Simulation(_small(kv_blocks=182), replace(traffic, first_visible=every_third)).run()
    assert later["hit_rate"] == plain["hit_rate"]
    assert later["ttft_p50_s"] > plain["ttft_p50_s"]
    wrong = ((sessions[0].id, (1,)),)
    with pytest.raises(ValueError, match="indices for"):
        Simulation(_small(), replace(traffic, first_visible=wrong)).run()


def test_an_agentx_file_replays_as_the_generated_trace_it_holds(tmp_path, capsys):
    from tandem.workload.trace import dump

    traffic = Traffic(sessions=3)
    path = dump(traffic.generate(), tmp_path / "trace.jsonl")
    from_file = Simulation(_small(), replace(traffic, trace_file=str(path))).run()
    generated = Simulation(_small(), traffic).run()
    assert {k: v for k, v in from_file.items() if k != "wall_s"} == {
        k: v for k, v in generated.items() if k != "wall_s"
    }
    assert sim_main(["run", "--trace", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == from_file["requests"]


def test_a_sweep_takes_router_replicas_and_state_lag_as_grid_axes(monkeypatch, tmp_path, capsys):
    import sim.cli

    ran: list[dict] = []

    def in_process(points, address=None, num_cpus=None):
        ran.extend(points)
        return [run_point(p) for p in points]

    monkeypatch.setattr(sim.cli, "run_on_ray", in_process)
    argv = ["sweep", "--policies", "cost", "--kv-blocks", "64", "--sessions", "2"]
    argv += ["--router-replicas", "1,2", "--state-lag-ms", "0,500", "--no-plot"]
    assert sim_main([*argv, "--out", str(tmp_path)]) == 0
    grid_axes = [(p["router_replicas"], p["state_lag_ms"]) for p in ran]
    assert grid_axes == [(1, 0.0), (1, 500.0), (2, 0.0), (2, 500.0)]
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["router_replicas"], r["state_lag_ms"]) for r in rows] == [
        ("1", "0.0"),
        ("1", "500.0"),
        ("2", "0.0"),
        ("2", "500.0"),
    ]
    capsys.readouterr()


def test_cli_solve_prints_the_solvers_split_within_the_budget(capsys):
    assert sim_main(["solve", "--budget", "6", "--hit-rate", "0.5", "--sessions", "2"]) == 0
    out = capsys.readouterr().out
    assert "trace: " in out and "hit rate 0.500" in out
    split = next(line for line in out.splitlines() if line.startswith("disaggregated:"))
    gpus = int(split.split("=")[1].split("GPUs")[0])
    assert 0 < gpus <= 6


def test_a_scaled_profile_runs_at_k_times_the_rate():
    from sim.defaults import scaled_profile

    prefill = load_profiles(CPU_PROFILES)["prefill"]
    double = scaled_profile(prefill, 2)
    assert double.config.gpus_per_replica == 2
    assert double.points[0].request_rate == pytest.approx(2 * prefill.points[0].request_rate)
    assert double.points[0].ttft_p90_s == pytest.approx(prefill.points[0].ttft_p90_s / 2)


@pytest.mark.parametrize("decode_runs", [True, False])
def test_shared_cores_lengthen_each_step_by_the_prompts_it_computes(decode_runs):
    """``shared_core_s``: a step that computes a prompt is longer by that
    much; a step of decodes alone is not, in runs and step by step."""

    def times(shared_core_s):
        loop, engine = _plain_engine(decode_runs, shared_core_s=shared_core_s)
        seen = {}

        def job(name, hashes, out):
            return Job(
                8,
                hashes,
                out,
                on_first_token=lambda j: seen.setdefault(f"{name} first", loop.now),
                on_done=lambda j: seen.setdefault(f"{name} done", loop.now),
            )

        engine.submit(job("a", [1, 2], 5))
        engine.submit(job("b", [3, 4], 5))
        loop.run()
        return seen

    plain, shared = times(0.0), times(0.25)
    # The idle engine starts a's prompt at once, b's in the next step (with
    # a's first decode): each 0.25 s longer; the decode steps after them not.
    assert shared["a first"] == pytest.approx(plain["a first"] + 0.25)
    for name in ("b first", "a done", "b done"):
        assert shared[name] == pytest.approx(plain[name] + 0.5)
