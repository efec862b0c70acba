"""The rate-matching controller closing its loop on live engines (issue 26,
item 3): the chart on the local cluster (devcluster/, `tandem cluster up`),
its pools profiled with `tandem profile` through the router's Service,
`scaling.mode: Auto`, rising demand from the agentic replay, and then
`Recommend` on the same cluster.

1. `tandem cluster up` on a bridge and addresses of its own; the chart
   rendered with the Helm SDK from helm/examples/local-cpu.yaml (1 prefill +
   1 decode engine; the decode pool may grow to `--max-decode`; the router
   runs with `--remote-prefill-threshold 0`, as the P/D profiles need, and
   keeps it for the whole run so that the profiles describe the routing the
   loop sees) and applied with kubectl.
2. Profiles: `tandem profile --role prefill` and `--role decode` against the
   router's Service (short levels), written to `OUT/profiles/` and applied
   as ConfigMaps; `--profiles DIR` applies `DIR/prefill.yaml` and
   `DIR/decode.yaml` from an earlier run instead.
3. Auto: `kubectl patch td` sets the mode, the profiles and the SLOs; then
   one replay per demand step (`--steps`, concurrent sessions), while a
   monitor polls the TandemDeployment's `status.scaling` (the decision, its
   reasons, `lastChange`), the engine pods (created, Ready, first request
   the pod served, from its own metrics) and the Events.
4. Recommend: the mode patched, the decode pool set back to 1 by hand
   (`kubectl scale`, as a user would), the top step replayed again: no pool
   may move, the recommendation must stay one value with one
   `ScalingRecommended` Event, and it must name the change.
5. Static shapes (`--static 1:1,1:2,2:1`): the mode set to `Off`, both pools
   scaled by hand to each P:D in turn and waited for (that many pods, all
   Ready, none draining), then the same demand steps (the same seeded trace;
   each replay salts its prompts, so no phase reuses another's cache). Each
   engine pod's own request counter says whether the router sent it work.
   `--no-auto` runs only these (no profiles needed); `--auto-from DIR`
   then compares them with the Auto phase of an earlier run.

Per step and per decision it reports: the operator's decision and reasons,
decision → the new pod Ready → its first routed request (s), and goodput
(requests per second within both SLOs), TTFT p90 and P90 interactivity of
the requests before the decision and of those after the new pod served;
with static shapes, per step Auto against each shape, and the best static
shape over the whole trace.
Everything is written to OUT/result.json and OUT/report.md.

    make live-loop                                 # profiles, Auto, Recommend
    python -m bench.live_loop --profiles DIR       # reuse profiles
    python -m bench.live_loop --steps 2,6,10 --step-s 180
    python -m bench.live_loop --profiles DIR --static 1:1,1:2,2:1
    python -m bench.live_loop --no-auto --static 1:1,1:2,2:1 --auto-from EARLIER

Needs root (the local cluster's pod network) and the prepared model; runs 2-3
vLLM engines for 20-40 minutes on 2 cores. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import yaml

from bench.harness import cluster_down, cluster_up, sigterm_as_interrupt, tandem_cli
from common.kube import LABEL_COMPONENT, LABEL_POOL
from common.model import cache_dir, resolve_model
from devcluster.client import LocalCluster
from operators.manifests import METRICS_PORT
from operators.planner.persist import from_rfc3339
from tandem.workload import generate
from tandem.workload.content import PromptBuilder
from tandem.workload.metrics import percentile, summarize
from tandem.workload.replay import ReplayConfig, Replayer, build_prompts, new_salt

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "tandem"
EXAMPLE = REPO / "helm" / "examples" / "local-cpu.yaml"
RELEASE = "tandem"
NAMESPACE = "default"
TD_API = "/apis/tandem.dev/v1alpha1"
# Its own bridge and addresses: a user's cluster (tandem0, 10.250.0.0/16), the
# journey (10.240) and the kubelet tests (10.200-239) may run beside it.
BRIDGE = "tdliveloop"
POD_CIDR = "10.246.0.0/16"
MODEL = "SmolLM2-135M-Instruct"
# Engines' KV cache: small, three engines must fit beside other work.
KV_CACHE_GIB = 1
KV_DTYPE_BYTES = 4  # float32 on CPU
POLL_S = 3.0
# Engine start on a loaded 2-core machine: 40-120 s seen; the whole install more.
INSTALL_DEADLINE_S = 1200.0


def log(msg: str) -> None:
    print(f"[live-loop {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the cluster ---------------------------------------------------------------


def td(cluster: LocalCluster) -> dict | None:
    return cluster.get(f"tandemdeployments/{RELEASE}", api=TD_API)


def values(max_prefill: int, max_decode: int) -> dict:
    """local-cpu.yaml for this run: the model as `tandem model` prepared it,
    one router (the demand the operator measures is its counters), the pools
    from 1 up to their maximum, a small KV cache, no store (it is not what the
    loop decides on, and it takes memory the engines need)."""
    model = resolve_model(None)
    v = yaml.safe_load(EXAMPLE.read_text())
    v["model"]["path"] = f"/models/{model.name}"
    v["model"]["volume"]["hostPath"] = str(model.parent)
    v["kvStore"] = {"enabled": False}
    v["router"]["replicas"] = 1
    v["router"]["args"] = ["--remote-prefill-threshold=0"]
    v["operator"]["replicas"] = 1
    small_kv = [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(KV_CACHE_GIB)}]
    v["prefill"] |= {"minReplicas": 1, "maxReplicas": max_prefill, "env": small_kv}
    v["decode"] |= {"minReplicas": 1, "maxReplicas": max_decode, "env": small_kv}
    return v


def render(v: dict) -> list[dict]:
    """The release's objects as `helm install` renders them (no test hooks)."""
    files = helm.Chart.load(CHART).render(v, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = [
        d
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d
    ]
    return [d for d in docs if "helm.sh/hook" not in d["metadata"].get("annotations", {})]


def kv_capacity_tokens() -> int:
    """Tokens of KV one engine holds: its cache over the model's bytes per token."""
    config = json.loads((resolve_model(None) / "config.json").read_text())
    heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * heads * head_dim * KV_DTYPE_BYTES
    return KV_CACHE_GIB * 2**30 // per_token


def ready(pod: dict) -> bool:
    return pod["metadata"].get("deletionTimestamp") is None and any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


# -- the workload --------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The agentic trace both the profiles and the loop replay."""

    sessions: int  # per demand step: enough that no lane runs out
    profile_sessions: int  # per profile level, whose prompts are built per level
    think_scale: float
    max_tokens_cap: int
    seed: int = 0

    def profile_args(self) -> list[str]:
        return [
            "--sessions",
            str(self.profile_sessions),
            "--seed",
            str(self.seed),
            "--think-scale",
            str(self.think_scale),
            "--max-tokens-cap",
            str(self.max_tokens_cap),
            "--no-progress",
            "--timeout",
            "300",
        ]

    def replay(self, url: str, concurrency: int, duration_s: float, tokenizer: Any) -> Replayer:
        sessions = generate.generate(
            generate.params_for("small", sessions=self.sessions, seed=self.seed)
        )
        builder = PromptBuilder(tokenizer, salt=new_salt())
        cfg = ReplayConfig(
            url=url,
            model=MODEL,
            concurrency=concurrency,
            think_scale=self.think_scale,
            max_tokens_cap=self.max_tokens_cap,
            duration_s=duration_s,
            timeout_s=300.0,
            session_end_header="x-session-end",
            progress=False,
        )
        return Replayer(cfg, sessions, build_prompts(sessions, builder), salt=builder.salt)


# -- profiles ------------------------------------------------------------------


def take_profiles(url: str, out: Path, w: Workload, concurrencies: str, level_s: float) -> None:
    kv = kv_capacity_tokens()
    for role in ("prefill", "decode"):
        log(f"tandem profile --role {role} (levels {concurrencies}, {level_s:g} s each)")
        result = tandem_cli(
            "profile",
            "--role",
            role,
            "--url",
            url,
            "--model",
            MODEL,
            "--name",
            f"smollm2-cpu-{role}",
            "--hardware",
            "cpu-core",
            "--gpus-per-replica",
            "1",
            "--kv-capacity-tokens",
            str(kv),
            "--concurrencies",
            concurrencies,
            "--level-s",
            str(level_s),
            "--namespace",
            NAMESPACE,
            "--out",
            str(out / f"{role}-runs"),
            "-o",
            str(out / f"{role}.yaml"),
            *w.profile_args(),
            timeout=3600,
        )
        sys.stderr.write(result.stderr[-3000:])
        if result.returncode:
            raise RuntimeError(f"tandem profile --role {role} failed ({result.returncode})")


# -- the monitor ---------------------------------------------------------------


@dataclass
class PodSeen:
    name: str
    role: str
    created: float
    ready: float | None = None
    first_served: float | None = None
    gone: float | None = None


@dataclass
class Monitor:
    """Polls what the operator decided and what the pods did, with wall times."""

    cluster: LocalCluster
    decisions: list[dict] = field(default_factory=list)  # each changed status.scaling
    pods: dict[str, PodSeen] = field(default_factory=dict)
    spec_replicas: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            while not stop.is_set():
                try:
                    await self.poll(client)
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    log(f"monitor: {exc!r}")
                try:
                    await asyncio.wait_for(stop.wait(), POLL_S)
                except TimeoutError:
                    pass

    async def poll(self, client: httpx.AsyncClient) -> None:
        now = time.time()
        base = f"{self.cluster.server}"
        td = (
            await client.get(f"{base}{TD_API}/namespaces/{NAMESPACE}/tandemdeployments/{RELEASE}")
        ).json()
        scaling = td.get("status", {}).get("scaling") or {}
        key = (scaling.get("lastDecisionTime"), json.dumps(scaling.get("replicas")))
        last = self.decisions[-1] if self.decisions else None
        if scaling.get("lastDecisionTime") and (last is None or last["key"] != list(key)):
            self.decisions.append(
                {
                    "key": list(key),
                    "seen": now,
                    "mode": scaling.get("mode"),
                    "recommendation": scaling.get("recommendation"),
                    "replicas": scaling.get("replicas"),
                    "targets": scaling.get("targets"),
                    "binding": scaling.get("binding"),
                    "summary": scaling.get("summary"),
                    "reasons": scaling.get("reasons"),
                    "changes": scaling.get("changes"),
                    "held": scaling.get("held"),
                    "lastChange": scaling.get("lastChange"),
                    "pools": scaling.get("pools"),
                    "demandRps": (scaling.get("history") or [{}])[-1].get("demandRps"),
                }
            )
        pools = (await client.get(f"{base}{TD_API}/namespaces/{NAMESPACE}/enginepools")).json()[
            "items"
        ]
        replicas = {
            p["metadata"]["name"].removeprefix(f"{RELEASE}-"): p["spec"]["replicas"] for p in pools
        }
        if not self.spec_replicas or self.spec_replicas[-1][1] != replicas:
            self.spec_replicas.append((now, replicas))
        pods = (
            await client.get(
                f"{base}/api/v1/namespaces/{NAMESPACE}/pods",
                params={"labelSelector": f"{LABEL_COMPONENT}=engine"},
            )
        ).json()["items"]
        names = set()
        for pod in pods:
            name = pod["metadata"]["name"]
            names.add(name)
            role = pod["metadata"]["labels"].get(LABEL_POOL, "").removeprefix(f"{RELEASE}-")
            seen = self.pods.setdefault(name, PodSeen(name, role, now))
            if seen.ready is None and ready(pod):
                seen.ready = now
            if seen.ready is not None and seen.first_served is None:
                ip = pod["status"]["podIP"]
                with_metrics = await client.get(f"http://{ip}:{METRICS_PORT}/metrics")
                if engine_requests(with_metrics.text) > 0:
                    seen.first_served = now
        for name, seen in self.pods.items():
            if name not in names and seen.gone is None:
                seen.gone = now


def engine_requests(metrics: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("tandem_engine_requests_total")
    )


# -- figures -------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    ttft_p90_ms: int
    interactivity_p90: float

    def met(self, r: dict) -> bool:
        return bool(
            r.get("ok")
            and r["ttft"] * 1000 <= self.ttft_p90_ms
            and r.get("output_tokens")
            and r["output_tokens"] / r["e2e"] >= self.interactivity_p90
        )


def figures(records: list[dict], start: float, end: float, slo: Slo) -> dict[str, Any]:
    """Over the requests that started in [start, end) (wall times): goodput
    (requests per second that met both SLOs), TTFT p90, P90 interactivity."""
    inside = [r for r in records if start <= r["wall_start"] < end]
    s = summarize(inside, duration_s=max(end - start, 1e-9))
    ok = [r for r in inside if r.get("ok")]
    return {
        "from": start,
        "to": end,
        "requests": len(inside),
        "failures": s["failures"],
        "goodput_rps": sum(1 for r in inside if slo.met(r)) / max(end - start, 1e-9),
        "throughput_rps": len(ok) / max(end - start, 1e-9),
        "ttft_p90_s": s["ttft_p90"],
        "interactivity_p90": s["interactivity_p90"],
        "e2e_p50_s": percentile([r["e2e"] for r in ok], 50),
    }


def records_of(result: Any) -> list[dict]:
    """A replay's records, each with the wall time it started."""
    return [dict(r, wall_start=result.started_at + r["start"]) for r in result.to_json()["records"]]


def scale_ups(monitor: Monitor, since: float, until: float) -> list[dict]:
    """Each change of a pool's spec replicas the operator made in [since,
    until), with the decision's reasons and its new pods' timings."""
    found = []
    changes = monitor.spec_replicas
    for (_, before), (seen, after) in zip(changes, changes[1:], strict=False):
        if not since <= seen < until:
            continue
        for role in sorted(after):
            if after[role] == before.get(role):
                continue
            decision = next(
                (
                    d
                    for d in monitor.decisions
                    if d["replicas"] and d["replicas"].get(role) == after[role]
                ),
                None,
            )
            decided = seen
            if decision and decision.get("lastChange", {}).get(role):
                decided = min(seen, from_rfc3339(decision["lastChange"][role]))
            new_pods = [
                p for p in monitor.pods.values() if p.role == role and p.created >= decided - POLL_S
            ]
            first = min(new_pods, key=lambda p: p.created) if new_pods else None
            found.append(
                {
                    "role": role,
                    "from": before.get(role),
                    "to": after[role],
                    "decided": decided,
                    "decision": decision,
                    "pod": None if first is None else first.name,
                    "ready_s": None
                    if first is None or first.ready is None
                    else first.ready - decided,
                    "serving_s": None
                    if first is None or first.first_served is None
                    else first.first_served - decided,
                    "serving_at": None if first is None else first.first_served,
                    "ready_at": None if first is None else first.ready,
                }
            )
    return found


def events(cluster: LocalCluster, since: float) -> list[dict]:
    """The TandemDeployment's Events from `since` on (wall time)."""
    items = (cluster.get("events") or {}).get("items", [])
    out = []
    for e in items:
        if e.get("involvedObject", {}).get("name") != RELEASE:
            continue
        stamp = e.get("lastTimestamp") or e.get("eventTime") or e.get("firstTimestamp")
        at = from_rfc3339(stamp[:19] + "Z") if stamp else 0.0
        if at >= since - 1:
            out.append(
                {
                    "at": at,
                    "type": e.get("type"),
                    "reason": e.get("reason"),
                    "message": e.get("message"),
                    "count": e.get("count", 1),
                }
            )
    return sorted(out, key=lambda e: e["at"])


# -- the run -------------------------------------------------------------------


@dataclass
class Run:
    cluster: LocalCluster
    url: str
    workload: Workload
    slo: Slo
    tokenizer: Any
    monitor: Monitor
    records: list[dict] = field(default_factory=list)

    async def steps(self, concurrencies: list[int], step_s: float) -> list[dict]:
        """One replay per step, back to back: every step's prompts are built
        first, so that demand does not dip between steps."""
        replayers = [
            self.workload.replay(self.url, c, step_s, self.tokenizer) for c in concurrencies
        ]
        out = []
        for c, replayer in zip(concurrencies, replayers, strict=True):
            log(f"demand step: {c} concurrent sessions for {step_s:g} s")
            start = time.time()
            records = records_of(await replayer.run())
            end = time.time()
            self.records += [dict(r, step=c) for r in records]
            step = {
                "concurrency": c,
                "start": start,
                "end": end,
                **figures(records, start, end, self.slo),
            }
            log(
                f"step c={c}: {step['requests']} requests, {step['failures']} failed, goodput "
                f"{step['goodput_rps']:.3f} req/s, TTFT p90 {step['ttft_p90_s']}"
            )
            out.append(step)
        return out


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


async def monitored(monitor: Monitor, work: Any) -> Any:
    stop = asyncio.Event()
    task = asyncio.create_task(monitor.run(stop))
    try:
        return await work
    finally:
        stop.set()
        await task


def patch_scaling(cluster: LocalCluster, scaling: dict) -> None:
    cluster.kubectl(
        "patch", "td", RELEASE, "--type", "merge", "-p", json.dumps({"spec": {"scaling": scaling}})
    )


def install(cluster: LocalCluster, release: Path) -> tuple[str, float]:
    """The release applied as `helm install` would; its router Service's URL
    once one engine per pool serves through it, and the seconds that took."""
    installed = time.monotonic()
    cluster.kubectl("apply", "-f", str(release))

    def serving() -> str | None:
        status = (td(cluster) or {}).get("status", {})
        url = cluster.service_url(f"{RELEASE}-router")
        if status.get("prefill") != "1/1" or status.get("decode") != "1/1" or not url:
            return None
        try:
            return url if httpx.get(f"{url}/health", timeout=5).status_code == 200 else None
        except httpx.HTTPError:
            return None

    url = cluster.wait(
        serving, INSTALL_DEADLINE_S, "the release serving through the router Service"
    )
    return url, time.monotonic() - installed


def apply_profiles(
    cluster: LocalCluster, a: argparse.Namespace, url: str, out: Path, w: Workload
) -> dict[str, Any]:
    """Profiles taken now (or an earlier run's, `--profiles`), applied."""
    found: dict[str, Any] = {}
    profiles = Path(a.profiles) if a.profiles else out / "profiles"
    if not a.profiles:
        took = time.monotonic()
        take_profiles(url, profiles, w, a.profile_concurrencies, a.profile_level_s)
        found["profile_s"] = time.monotonic() - took
    for role in ("prefill", "decode"):
        cluster.kubectl("apply", "-f", str(profiles / f"{role}.yaml"))
    found["profiles"] = {
        role: yaml.safe_load((profiles / f"{role}.yaml").read_text())["data"]["profile.json"]
        for role in ("prefill", "decode")
    }
    return found


def never_routed(up: dict[str, Any]) -> str:
    left = up.get("ready_before_end_s")
    return "never" if left is None else f"never (Ready {left:.0f} s before the phase ended)"


def auto_phase(r: Run, a: argparse.Namespace) -> dict[str, Any]:
    """`scaling.mode: Auto` through the demand steps: each decision, its new
    pod's timings, and the figures before it and after the pod served."""
    cluster, monitor, slo = r.cluster, r.monitor, r.slo
    auto_from = time.time()
    patch_scaling(
        cluster,
        {
            "mode": "Auto",
            "profiles": {"prefill": "smollm2-cpu-prefill", "decode": "smollm2-cpu-decode"},
            "slo": {"ttftP90Ms": slo.ttft_p90_ms, "interactivityP90": slo.interactivity_p90},
            "upCooldownSeconds": a.up_cooldown_s,
            "gpuBudget": a.engine_budget,
            "maxStep": 1,
        },
    )
    steps = asyncio.run(monitored(monitor, r.steps(a.steps, a.step_s)))
    auto_to = time.time()
    ups = scale_ups(monitor, auto_from, auto_to)
    for up in ups:
        decided = up["decided"]
        # After: from the new pod's first routed request, else (never
        # routed) from its Ready, so that the table says what it cost.
        serving_at = up["serving_at"] or up["ready_at"]
        up["after_from"] = "first routed request" if up["serving_at"] else "Ready, never routed"
        # A pod Ready just before the phase ended had no chance to be routed.
        up["ready_before_end_s"] = auto_to - up["ready_at"] if up["ready_at"] else None
        step = next((s for s in steps if s["start"] <= decided < s["end"]), steps[-1])
        up["step"] = step["concurrency"]
        # The demand the after-window saw: it may start in a later step.
        up["after_step"] = next(
            (x["concurrency"] for x in steps if serving_at and x["start"] <= serving_at < x["end"]),
            None,
        )
        up["before"] = figures(r.records, max(step["start"], decided - a.window_s), decided, slo)
        up["after"] = (
            None
            if serving_at is None
            else figures(r.records, serving_at, min(auto_to, serving_at + a.window_s), slo)
        )
    return {
        "steps": steps,
        "scale_changes": ups,
        "decisions": monitor.decisions,
        "events": events(cluster, auto_from),
        "pods": [p.__dict__ for p in monitor.pods.values()],
        "load_average": load_average(),
    }


def engine_pods(cluster: LocalCluster) -> list[dict]:
    found = cluster.get("pods", labelSelector=f"{LABEL_COMPONENT}=engine") or {}
    return found.get("items", [])


def set_pools(cluster: LocalCluster, shape: dict[str, int]) -> None:
    """Each pool scaled by hand, as a user would, and waited for: exactly
    its replicas in pods, all Ready, none still draining."""
    for role, n in shape.items():
        cluster.kubectl("scale", f"enginepool/{RELEASE}-{role}", "--replicas", str(n))

    def settled() -> bool:
        pods = engine_pods(cluster)
        for role, n in shape.items():
            mine = [
                p for p in pods if p["metadata"]["labels"].get(LABEL_POOL) == f"{RELEASE}-{role}"
            ]
            if len(mine) != n or not all(ready(p) for p in mine):
                return False
        return True

    cluster.wait(settled, 600, f"pools at {shape_name(shape)}")


def recommend_phase(r: Run, a: argparse.Namespace) -> dict[str, Any]:
    """Recommend with the pools set back to 1:1 by hand, the top step
    again: nothing may move, one Event per changed recommendation."""
    cluster = r.cluster
    patch_scaling(cluster, {"mode": "Recommend"})
    set_pools(cluster, {"prefill": 1, "decode": 1})
    rec_monitor = Monitor(cluster)
    rec_from = time.time()
    rec_steps = asyncio.run(monitored(rec_monitor, r.steps([a.steps[-1]], a.recommend_s)))
    rec_to = time.time()
    rec_events = [e for e in events(cluster, rec_from) if e["reason"] == "ScalingRecommended"]
    recommended = [d["recommendation"] for d in rec_monitor.decisions if d["mode"] == "Recommend"]
    return {
        "steps": rec_steps,
        "spec_replicas": rec_monitor.spec_replicas,
        "moved": len({json.dumps(s[1], sort_keys=True) for s in rec_monitor.spec_replicas}) > 1,
        "recommendations": recommended,
        "distinct": sorted(set(recommended)),
        "events": rec_events,
        "event_count": sum(e["count"] for e in rec_events),
        "last": rec_monitor.decisions[-1] if rec_monitor.decisions else None,
        "seconds": rec_to - rec_from,
        "load_average": load_average(),
    }


def served_per_pod(cluster: LocalCluster) -> dict[str, float]:
    """Requests each engine pod has served, from its own metrics."""
    out = {}
    for pod in engine_pods(cluster):
        ip = pod["status"]["podIP"]
        text = httpx.get(f"http://{ip}:{METRICS_PORT}/metrics", timeout=10).text
        out[pod["metadata"]["name"]] = engine_requests(text)
    return out


def static_phase(r: Run, a: argparse.Namespace, shape: dict[str, int]) -> dict[str, Any]:
    """One shape held fixed (`scaling.mode: Off`) through the same demand
    steps; that every engine pod served requests is checked from their
    metrics (a pod the router never found would serve none)."""
    patch_scaling(r.cluster, {"mode": "Off"})
    set_pools(r.cluster, shape)
    log(f"static {shape_name(shape)}: pools Ready")
    before = served_per_pod(r.cluster)
    steps = asyncio.run(r.steps(a.steps, a.step_s))
    after = served_per_pod(r.cluster)
    return {
        "shape": shape_name(shape),
        "steps": steps,
        "served_per_pod": {name: n - before.get(name, 0.0) for name, n in after.items()},
        "load_average": load_average(),
    }


def shape_name(shape: dict[str, int]) -> str:
    return f"{shape['prefill']}:{shape['decode']}"


def parse_shape(text: str) -> dict[str, int]:
    prefill, sep, decode = text.partition(":")
    if not (sep and prefill.isdigit() and decode.isdigit()) or min(int(prefill), int(decode)) < 1:
        raise argparse.ArgumentTypeError(f"a static shape is P:D, each at least 1: {text!r}")
    return {"prefill": int(prefill), "decode": int(decode)}


def run(a: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    out = Path(a.out) if a.out else cache_dir() / "live-loop" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    state = out / "cluster"
    w = Workload(a.sessions, a.profile_sessions, a.think_scale, a.max_tokens_cap)
    slo = Slo(a.ttft_slo_ms, a.interactivity_slo)
    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "load_average_start": load_average(),
        "slo": {"ttftP90Ms": slo.ttft_p90_ms, "interactivityP90": slo.interactivity_p90},
        "workload": w.__dict__,
        "step_s": a.step_s,
    }
    if a.auto_from:
        earlier = json.loads((Path(a.auto_from) / "result.json").read_text())
        first = earlier["auto"]["steps"][0]
        result["auto"] = dict(
            earlier["auto"], run=str(a.auto_from), step_s=first["end"] - first["start"]
        )
    release = out / "release.yaml"
    release.write_text(yaml.safe_dump_all(render(values(a.max_prefill, a.max_decode))))
    log(f"tandem cluster up ({state})")
    cluster = cluster_up(state, BRIDGE, POD_CIDR)

    def save() -> None:  # after each phase: a run stopped midway keeps what it measured
        (out / "result.json").write_text(json.dumps(result, indent=1, default=str))

    interrupted = False
    try:
        url, result["install_s"] = install(cluster, release)
        log(f"installed in {result['install_s']:.0f} s; router Service at {url}")
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
        r = Run(cluster, url, w, slo, tokenizer, Monitor(cluster))
        if not a.no_auto:
            result |= apply_profiles(cluster, a, url, out, w)
            result["auto"] = auto_phase(r, a)
            save()
            result["recommend"] = recommend_phase(r, a)
            save()
        result["static"] = []
        for shape in a.static:
            fixed = Run(cluster, url, w, slo, tokenizer, Monitor(cluster))
            result["static"].append(static_phase(fixed, a, shape))
            save()
    except KeyboardInterrupt:
        interrupted = True  # stopped: the cluster goes down at once, no graceful uninstall
        raise
    finally:
        if not interrupted:
            try:
                cluster.kubectl("delete", "td", RELEASE, "--wait=true", "--timeout=300s")
                cluster.kubectl(
                    "delete",
                    "-f",
                    str(release),
                    "--ignore-not-found",
                    "--wait=true",
                    "--timeout=300s",
                )
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                log(f"uninstall: {exc}")
        cluster.close()
        cluster_down(state)
    result["load_average_end"] = load_average()
    save()
    report = render_report(result)
    (out / "report.md").write_text(report)
    print(report)
    log(f"written to {out}")
    return result


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def render_report(result: dict[str, Any]) -> str:
    auto = result.get("auto", {})
    lines = [
        f"live loop: `{result['command']}`; load average {result['load_average_start']} at the "
        f"start, {result['load_average_end']} at the end; SLO TTFT p90 "
        f"{result['slo']['ttftP90Ms']} ms, interactivity p90 "
        f"{result['slo']['interactivityP90']} tok/s",
        "",
        "| step (sessions) | requests | failed | goodput req/s | TTFT p90 s "
        "| interactivity p90 tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for s in auto.get("steps", []):
        lines.append(
            f"| {s['concurrency']} | {s['requests']} | {s['failures']} "
            f"| {_f(s['goodput_rps'], '{:.3f}')} "
            f"| {_f(s['ttft_p90_s'])} | {_f(s['interactivity_p90'], '{:.1f}')} |"
        )
    lines += [
        "",
        "| step | decision | reasons | decision→Ready s | decision→first routed request s "
        "| goodput before→after | TTFT p90 before→after | interactivity before→after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for up in auto.get("scale_changes", []):
        b, af = up["before"], up.get("after") or {}
        reasons = "; ".join(((up.get("decision") or {}).get("reasons") or [])[:2])
        lines.append(
            f"| {up['step']} | {up['role']} {up['from']} → {up['to']} | {reasons} "
            f"| {_f(up['ready_s'], '{:.0f}')} "
            f"| {_f(up['serving_s'], '{:.0f}') if up['serving_at'] else never_routed(up)} "
            f"| {_f(b['goodput_rps'], '{:.3f}')} → {_f(af.get('goodput_rps'), '{:.3f}')} "
            f"(after: {up.get('after_step')} sessions, from {up.get('after_from')}) "
            f"| {_f(b['ttft_p90_s'])} → {_f(af.get('ttft_p90_s'))} "
            f"| {_f(b['interactivity_p90'], '{:.1f}')} → "
            f"{_f(af.get('interactivity_p90'), '{:.1f}')} |"
        )
    rec = result.get("recommend")
    if rec:
        last = rec.get("last") or {}
        lines += [
            "",
            f"Recommend ({rec['seconds']:.0f} s): pools moved: {rec['moved']}; recommendations "
            f"seen {rec['distinct']}; ScalingRecommended events {rec['event_count']}; last: "
            f"{last.get('recommendation')} — {last.get('summary')}; changes: {last.get('changes')}",
        ]
        lines += [f"  event: {e['message']}" for e in rec["events"]]
    if result.get("static"):
        lines += ["", *render_static(result)]
    return "\n".join(lines) + "\n"


def trace_goodput(steps: list[dict]) -> float:
    """Requests within both SLOs per second over all the steps."""
    good = sum(s["goodput_rps"] * (s["to"] - s["from"]) for s in steps)
    return good / max(sum(s["to"] - s["from"] for s in steps), 1e-9)


def render_static(result: dict[str, Any]) -> list[str]:
    """Per demand step, Auto against each shape held fixed on the same trace
    (goodput req/s, TTFT p90 s, P90 interactivity tok/s), and the best."""
    auto, static = result.get("auto"), result["static"]
    runs = ([("Auto", auto["steps"])] if auto else []) + [
        (f"static {x['shape']}", x["steps"]) for x in static
    ]
    lines = []
    if auto and auto.get("run"):
        lines.append(
            f"Auto from the earlier run {auto['run']} ({auto['step_s']:.0f} s steps; "
            f"these: {result['step_s']:.0f} s)"
        )
    lines += [
        "| step (sessions) | " + " | ".join(name for name, _ in runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    concurrencies = [s["concurrency"] for s in static[0]["steps"]]
    for i, c in enumerate(concurrencies):
        cells = []
        for _, steps in runs:
            x = steps[i] if i < len(steps) and steps[i]["concurrency"] == c else None
            cells.append(
                "—"
                if x is None
                else f"{_f(x['goodput_rps'], '{:.3f}')} / {_f(x['ttft_p90_s'], '{:.1f}')} / "
                f"{_f(x['interactivity_p90'], '{:.1f}')} ({x['failures']} failed)"
            )
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    whole = {name: trace_goodput(steps) for name, steps in runs}
    lines.append(
        "| whole trace, goodput | " + " | ".join(f"{whole[name]:.3f}" for name, _ in runs) + " |"
    )
    best = max((x for x in static), key=lambda x: trace_goodput(x["steps"]))
    lines += [
        "",
        "cells: goodput req/s / TTFT p90 s / P90 interactivity tok/s; best static over the "
        f"trace: {best['shape']} ({trace_goodput(best['steps']):.3f} req/s within the SLOs)",
    ]
    for x in static:
        idle = [name for name, n in x["served_per_pod"].items() if n <= 0]
        if idle:
            lines.append(f"static {x['shape']}: pods that served nothing: {', '.join(idle)}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.live_loop",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--profiles", help="apply DIR/prefill.yaml and DIR/decode.yaml instead of profiling"
    )
    p.add_argument("--steps", default="2,6,10", help="demand steps, concurrent sessions (2,6,10)")
    p.add_argument("--step-s", type=float, default=180.0, help="seconds per demand step (180)")
    p.add_argument("--recommend-s", type=float, default=150.0, help="seconds of Recommend (150)")
    p.add_argument(
        "--window-s",
        type=float,
        default=90.0,
        help="figures before a decision and after its pod served, seconds (90)",
    )
    p.add_argument("--max-prefill", type=int, default=2, help="prefill pool's maxReplicas (2)")
    p.add_argument("--max-decode", type=int, default=2, help="decode pool's maxReplicas (2)")
    p.add_argument(
        "--engine-budget",
        type=int,
        default=3,
        help="scaling.gpuBudget: engines all pools may run together, each profile "
        "counting one core per replica as its GPU (3)",
    )
    p.add_argument("--up-cooldown-s", type=int, default=30, help="scaling.upCooldownSeconds (30)")
    p.add_argument("--ttft-slo-ms", type=int, default=8000, help="scaling.slo.ttftP90Ms (8000)")
    p.add_argument(
        "--interactivity-slo",
        type=float,
        default=2.5,
        help="scaling.slo.interactivityP90, tokens/s per user (2.5: on 2 loaded cores "
        "the decode profile reaches about 3)",
    )
    p.add_argument(
        "--sessions", type=int, default=60, help="sessions of the trace per demand step (60)"
    )
    p.add_argument(
        "--profile-sessions", type=int, default=40, help="sessions per profile level (40)"
    )
    p.add_argument("--think-scale", type=float, default=1.0, help="trace think times x (1)")
    p.add_argument("--max-tokens-cap", type=int, default=48, help="cap on output tokens (48)")
    p.add_argument("--profile-concurrencies", default="1,2,4", help="profile levels (1,2,4)")
    p.add_argument("--profile-level-s", type=float, default=40.0, help="seconds per level (40)")
    p.add_argument(
        "--static",
        default="",
        help="after Auto and Recommend, hold each P:D shape fixed (mode Off) through the "
        "same demand steps, e.g. 1:1,1:2,2:1 (none)",
    )
    p.add_argument(
        "--no-auto", action="store_true", help="run only the --static shapes (no profiles needed)"
    )
    p.add_argument(
        "--auto-from",
        help="with --no-auto: compare the static shapes with the Auto phase of an earlier "
        "run's DIR/result.json",
    )
    p.add_argument("--out", help="results folder (default ~/.cache/tandem/live-loop/<time>)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.steps = [int(c) for c in a.steps.split(",")]
    try:
        a.static = [parse_shape(x) for x in a.static.split(",") if x]
    except argparse.ArgumentTypeError as exc:
        print(f"bench.live_loop: {exc}", file=sys.stderr)
        return 2
    if a.no_auto and not a.static:
        print("bench.live_loop: --no-auto needs --static shapes", file=sys.stderr)
        return 2
    if a.auto_from and not a.no_auto:
        print("bench.live_loop: --auto-from goes with --no-auto", file=sys.stderr)
        return 2
    too_big = [x for x in a.static if x["prefill"] > a.max_prefill or x["decode"] > a.max_decode]
    if too_big:
        print(
            f"bench.live_loop: {shape_name(too_big[0])} is above --max-prefill/--max-decode",
            file=sys.stderr,
        )
        return 2
    if os.geteuid() != 0:
        print("bench.live_loop: the local cluster's pod network needs root", file=sys.stderr)
        return 2
    try:
        with sigterm_as_interrupt():
            run(a)
    except KeyboardInterrupt:
        print(
            "bench.live_loop: interrupted; the phases done are in OUT/result.json", file=sys.stderr
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
