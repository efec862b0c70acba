"""Cross-check with an independent client: the same requests, replayed by our
client and by aiperf (NVIDIA's benchmark harness, the base of the AgentX
harness), against the same endpoint; their TTFT, ITL and throughput must agree
within a stated tolerance.

By default the two clients run side by side (our replay starts the moment
aiperf's profiling phase begins), each at the given concurrency: both then see
the same server under the same load, so the drift of a shared machine cannot
favour either, and each instrument has to report what the other saw. With
``side_by_side=False`` they run one after the other.

To compare instruments rather than schedulers, both replay the same flattened
workload: every agent (main and sub-agent) of the trace becomes one session of
self-contained requests sent in order, with no think time, at the same
concurrency, with the same ``max_tokens`` and ``ignore_eos``. aiperf gets it as
its ``single_turn`` dataset (``session_id`` keeps the order within a session,
``output_length`` the output, no history is accumulated) and sends each prompt
as one user message, exactly as our client does, so the server sees the same
token sequences. Each client gets its own content salt (same structure, new
tokens) so neither starts on the other's cached prefixes.

aiperf pins its own dependencies: it lives in its own virtual environment, made
by ``bench/setup_aiperf.sh`` (default ``.tandem/venv-aiperf``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.workload.content import PromptBuilder, scope_key
from tandem.workload.replay import ReplayConfig, Replayer, build_prompts, new_salt
from tandem.workload.trace import Request, Session, Subagent

AIPERF_VERSION = "0.13.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_AIPERF = REPO_ROOT / ".tandem" / "venv-aiperf" / "bin" / "aiperf"


def find_aiperf(explicit: str | None = None) -> Path:
    cand = Path(explicit or os.environ.get("TANDEM_AIPERF") or DEFAULT_AIPERF)
    if not cand.is_file():
        raise FileNotFoundError(
            f"aiperf not found at {cand}; create its virtual environment with "
            f"`bench/setup_aiperf.sh` (installs aiperf=={AIPERF_VERSION} into "
            f".tandem/venv-aiperf) or pass --aiperf PATH / set TANDEM_AIPERF"
        )
    return cand


def flatten_agents(sessions: list[Session]) -> list[Session]:
    """Every agent as its own session of plain requests, think time removed."""
    flat: list[Session] = []

    def walk(s: Session, entries, path: str):
        own = []
        for i, e in enumerate(entries):
            if isinstance(e, Request):
                own.append(replace(e, think_time=0.0))
            elif isinstance(e, Subagent):
                name = e.agent_id or f"sa{i}"
                walk(s, e.requests, f"{path}/{name}" if path else name)
        if own:
            # keep the original scope for hash ids: local ids stay per trace
            extra = dict(s.extra, origin=s.id)
            flat.append(
                Session(
                    id=f"{s.id}/{path}" if path else s.id,
                    block_size=s.block_size,
                    requests=own,
                    hash_id_scope=s.hash_id_scope,
                    models=s.models,
                    extra=extra,
                )
            )

    for s in sessions:
        walk(s, s.requests, "")
    return flat


def _scope(s: Session) -> str:
    return scope_key(s.extra.get("origin", s.id), s.hash_id_scope)


def write_aiperf_input(
    flat: list[Session], builder: PromptBuilder, path: Path, max_tokens_cap: int | None
) -> dict[tuple[str, int], int]:
    """Write aiperf's single_turn JSONL; returns the expected prompt tokens of
    each (session id, turn index)."""
    expected: dict[tuple[str, int], int] = {}
    with path.open("w") as f:
        for s in flat:
            for turn, r in enumerate(s.requests):
                p = builder.build(_scope(s), r.hash_ids, r.in_tokens, s.block_size)
                out = max(1, r.out_tokens)
                if max_tokens_cap:
                    out = min(out, max_tokens_cap)
                f.write(
                    json.dumps(
                        {"session_id": s.id, "text": p.messages[0]["content"], "output_length": out}
                    )
                    + "\n"
                )
                expected[(s.id, turn)] = p.expected_prompt_tokens
    return expected


def aiperf_prompt_check(artifact_dir: Path, expected: dict[tuple[str, int], int]) -> dict:
    """Compare the prompt lengths the server reported to aiperf with the
    prompts we built: equal lengths show aiperf sent the same token structure."""
    files = sorted(artifact_dir.rglob("profile_export.jsonl"))
    if not files:
        return {"checked": 0, "equal": 0}
    checked = equal = 0
    for line in files[-1].read_text().splitlines():
        d = json.loads(line)
        meta, m = d.get("metadata", {}), d.get("metrics", {})
        isl = (m.get("input_sequence_length") or {}).get("value")
        key = (meta.get("conversation_id"), meta.get("turn_index"))
        if isl is None or key not in expected:
            continue
        checked += 1
        equal += int(isl) == expected[key]
    return {"checked": checked, "equal": equal}


def _metric(export: dict, tag: str, stat: str) -> float | None:
    node = export.get(tag)
    if node is None:
        for v in export.values():  # some versions nest under "records"
            if isinstance(v, dict) and tag in v:
                node = v[tag]
                break
    if not isinstance(node, dict):
        return None
    val = node.get(stat)
    if val is None:
        return None
    unit = str(node.get("unit", "")).lower()
    if unit == "ms":
        return float(val) / 1000.0
    if unit in ("ns",):
        return float(val) / 1e9
    return float(val)


class AiperfRun:
    """One aiperf ``profile`` process, started in the background."""

    def __init__(
        self,
        aiperf: Path,
        url: str,
        model: str,
        tokenizer_dir: str,
        input_file: Path,
        concurrency: int,
        requests: int,
        artifact_dir: Path,
        timeout_s: float,
    ):
        self.cmd = [
            str(aiperf),
            "profile",
            "--model",
            model,
            "--url",
            url,
            "--endpoint-type",
            "chat",
            "--streaming",
            "--custom-dataset-type",
            "single_turn",
            "--input-file",
            str(input_file),
            "--concurrency",
            str(concurrency),
            "--request-count",
            str(requests),
            "--tokenizer",
            str(tokenizer_dir),
            "--use-server-token-count",
            "--extra-inputs",
            "ignore_eos:true",
            "--extra-inputs",
            "temperature:0",
            "--artifact-dir",
            str(artifact_dir),
            "--ui-type",
            "none",
            "--request-timeout-seconds",
            str(int(timeout_s)),
            "--random-seed",
            "0",
            # few service processes: the machine may have 2 cores
            "--workers-max",
            "2",
            "--record-processors",
            "1",
        ]
        self.dir = artifact_dir
        self.timeout_s = timeout_s
        artifact_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = artifact_dir / "aiperf.log"
        self.t0 = time.time()
        self._log = self.log_path.open("w")
        self._log.write(" ".join(self.cmd) + "\n")
        self._log.flush()
        # aiperf's offline mode resolves tokenizers as hub snapshots only, so a
        # local model folder must be loaded with offline mode off.
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
        }
        # its services must register within 30 s by default; a loaded 2-core
        # machine needs longer
        env.setdefault("AIPERF_SERVICE_REGISTRATION_TIMEOUT", "600")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_profiling(self, timeout_s: float = 900.0) -> None:
        """Block until aiperf has started sending (its profiling phase began)."""
        deadline = time.time() + timeout_s
        log = self.dir / "logs" / "aiperf.log"
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._fail()
            if log.is_file() and "Phase profiling (profiling) started" in log.read_text(
                errors="replace"
            ):
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"aiperf did not start sending within {timeout_s:.0f}s; log {self.log_path}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _fail(self):
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"aiperf failed (exit {self.proc.returncode}); log {self.log_path}:\n{tail}"
        )

    def finish(self) -> dict[str, Any]:
        try:
            self.proc.wait(self.timeout_s + 600)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"aiperf did not finish; log {self.log_path}") from None
        finally:
            self._log.close()
        exports = sorted(self.dir.rglob("profile_export_aiperf.json"))
        if self.proc.returncode != 0 or not exports:
            self._fail()
        export = json.loads(exports[-1].read_text())
        return {
            "command": self.cmd,
            "wall_s": time.time() - self.t0,
            "export": str(exports[-1]),
            "ttft_p50": _metric(export, "time_to_first_token", "p50"),
            "ttft_p90": _metric(export, "time_to_first_token", "p90"),
            "ttft_p99": _metric(export, "time_to_first_token", "p99"),
            "itl_p50": _metric(export, "inter_token_latency", "p50"),
            "output_tokens_per_s": _metric(export, "output_token_throughput", "avg"),
            "requests_per_s": _metric(export, "request_throughput", "avg"),
            "requests": _metric(export, "request_count", "avg"),
            "errors": _metric(export, "error_request_count", "avg") or 0,
        }


COMPARED = ("ttft_p50", "ttft_p90", "itl_p50", "output_tokens_per_s", "requests_per_s")


def compare(ours: dict[str, Any], theirs: dict[str, Any], tolerance: float) -> dict:
    rows = []
    ok = True
    for key in COMPARED:
        a, b = ours.get(key), theirs.get(key)
        if a is None or b is None or b == 0:
            rows.append({"metric": key, "ours": a, "aiperf": b, "rel_diff": None, "within": False})
            ok = False
            continue
        diff = (a - b) / b
        within = abs(diff) <= tolerance
        ok &= within
        rows.append({"metric": key, "ours": a, "aiperf": b, "rel_diff": diff, "within": within})
    return {"tolerance": tolerance, "agree": ok, "rows": rows}


def crosscheck(
    sessions: list[Session],
    cfg: ReplayConfig,
    tokenizer,
    tokenizer_dir: str,
    out_dir: Path,
    tolerance: float = 0.25,
    aiperf: str | None = None,
    side_by_side: bool = True,
    log=print,
) -> dict[str, Any]:
    import asyncio

    from tandem.workload import metrics

    aiperf_bin = find_aiperf(aiperf)
    flat = flatten_agents(sessions)
    n_requests = sum(len(s.requests) for s in flat)
    out_dir.mkdir(parents=True, exist_ok=True)

    our_builder = PromptBuilder(tokenizer, salt=new_salt())
    prompts = build_prompts(flat, our_builder)
    our_cfg = replace(cfg, think_scale=0.0)
    their_builder = PromptBuilder(tokenizer, salt=new_salt())
    input_file = out_dir / "aiperf_input.jsonl"
    expected = write_aiperf_input(flat, their_builder, input_file, cfg.max_tokens_cap)

    def aiperf_run() -> AiperfRun:
        log(f"crosscheck: aiperf {aiperf_bin}")
        return AiperfRun(
            aiperf_bin,
            cfg.url,
            cfg.model,
            tokenizer_dir,
            input_file,
            cfg.concurrency,
            n_requests,
            out_dir / "aiperf",
            cfg.timeout_s,
        )

    def ours_run():
        log(
            f"crosscheck: our client, {n_requests} requests from {len(flat)} agents, "
            f"concurrency {cfg.concurrency}"
        )
        return asyncio.run(Replayer(our_cfg, flat, prompts, salt=our_builder.salt).run())

    if side_by_side:
        # both clients at once: each sees the same server under the same load,
        # which a shared machine's drift cannot bias
        run = aiperf_run()
        try:
            run.wait_profiling()
            result = ours_run()
        except BaseException:
            run.stop()
            raise
        theirs = run.finish()
    else:
        result = ours_run()
        theirs = aiperf_run().finish()
    ours = metrics.summarize([r.__dict__ for r in result.records], result.duration_s)
    theirs["prompt_check"] = aiperf_prompt_check(out_dir / "aiperf", expected)
    cmp = compare(ours, theirs, tolerance)
    doc = {
        "kind": "tandem-agentx-crosscheck",
        "endpoint": cfg.url,
        "model": cfg.model,
        "mode": "side by side" if side_by_side else "one after the other",
        "concurrency": cfg.concurrency,
        "requests": n_requests,
        "agents": len(flat),
        "ours": {
            k: ours.get(k)
            for k in COMPARED + ("ttft_p99", "failures", "ok", "hit_rate", "duration_s")
        },
        "aiperf": theirs,
        "comparison": cmp,
    }
    (out_dir / "crosscheck.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "crosscheck.md").write_text(crosscheck_markdown(doc))
    return doc


def crosscheck_markdown(doc: dict) -> str:
    cmp = doc["comparison"]
    lines = [
        "# Cross-check: our replay client vs aiperf",
        "",
        f"Endpoint `{doc['endpoint']}` (model `{doc['model']}`), {doc['requests']} requests "
        f"from {doc['agents']} agents, concurrency {doc['concurrency']} per client, no "
        f"think time, same prompts' structure (different content salt per client), "
        f"clients run {doc.get('mode', 'one after the other')}. aiperf "
        f"{AIPERF_VERSION}.",
        "",
        f"Tolerance ±{100 * cmp['tolerance']:.0f}% relative: "
        f"**{'agree' if cmp['agree'] else 'DISAGREE'}**.",
        "",
        "| metric | ours | aiperf | difference | within |",
        "|---|---:|---:|---:|:---:|",
    ]
    for row in cmp["rows"]:

        def f(v):
            return "—" if v is None else f"{v:.4g}"

        d = "—" if row["rel_diff"] is None else f"{100 * row['rel_diff']:+.1f}%"
        lines.append(
            f"| {row['metric']} | {f(row['ours'])} | {f(row['aiperf'])} | {d} | "
            f"{'yes' if row['within'] else 'no'} |"
        )
    pc = doc["aiperf"].get("prompt_check", {})
    lines += [
        "",
        f"Our failures: {doc['ours'].get('failures')}; aiperf errors: "
        f"{doc['aiperf'].get('errors')}. Prompt lengths the server reported to aiperf "
        f"equal to the built prompts: {pc.get('equal')} of {pc.get('checked')} "
        f"(same token structure). Times in seconds, throughput per second.",
        "",
    ]
    return "\n".join(lines)
