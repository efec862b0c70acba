"""Which output token a recorded run's client saw first, per request.

The replay client (`tandem.workload.replay`) times a request's first chunk
*with text*, and the engines skip special tokens when they detokenize: on the
replay's filler prompts greedy SmolLM2 often begins with ``<|im_end|>`` or
``<|im_start|>``, so the measured TTFT is the second or third token's. The
replay samples greedily, so the tokens are a function of the prompt: this
tool rebuilds every prompt of a recorded run (its trace parameters and its
content salt, from its ``run.json``), sends each straight to an engine's
``Generate`` as the router would (greedy, ``ignore_eos``, special tokens
skipped) and records the index of the first token that brought text — 0
when the first token shows. ``sim validate`` times each simulated request's
first visible token from it.

    python -m bench.first_visible RUN.json... --engine HOST:PORT [--engine ...] \\
        --out first-visible.json [--into sim/measured.json]

Start the engines as the runs' were (e.g. ``tandem up --aggregated 2
--no-kv-store --max-model-len 3072``; their gRPC addresses are in the engine
logs); each engine takes whole runs, a session's requests in order so that
its prefix cache serves their shared context. ``--into`` writes each run's
indices into the ``sim/measured.json`` entry with its salt.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

from common.model import resolve_model
from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc
from tandem.workload.content import PromptBuilder
from tandem.workload.generate import GenParams, generate
from tandem.workload.replay import build_prompts


def first_text_index(stub: Any, token_ids: list[int], max_tokens: int, timeout: float) -> int:
    """The index of the first output token that brought text (greedy, as the
    replay asks); ``max_tokens`` when none did. The call is cancelled once
    text came."""
    call = stub.Generate(
        pb.GenerateRequest(
            request_id=f"fv-{uuid.uuid4().hex[:12]}",
            token_ids=token_ids,
            sampling_params=pb.SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                skip_special_tokens=True,
            ),
        ),
        timeout=timeout,
    )
    seen = 0
    try:
        for msg in call:
            seen += len(msg.token_ids)
            if msg.text:
                # The client's chunk comes with this message, i.e. with its last token.
                return seen - 1
    finally:
        call.cancel()
    return max_tokens


# Per session, each request's prompt tokens and max_tokens.
Prompts = dict[str, list[tuple[list[int], int]]]


def run_prompts(run: dict[str, Any], builder: PromptBuilder) -> Prompts:
    """Per session of the run's trace, each request's prompt tokens and
    ``max_tokens``, in ``Session.iter_requests`` order."""
    sessions = generate(GenParams(**run["trace"]["params"]))
    prompts = build_prompts(sessions, builder)
    max_tokens = {(r["session"], r["agent"], r["turn"]): r["max_tokens"] for r in run["records"]}
    return {
        s.id: [
            (
                prompts[id(r)].token_ids,
                max_tokens.get((s.id, "/".join(path), turn), max(1, r.out_tokens)),
            )
            for path, turn, r in s.iter_requests()
        ]
        for s in sessions
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.first_visible",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", type=Path, help="run.json files of recorded replays")
    p.add_argument(
        "--engine",
        action="append",
        required=True,
        help="an engine's gRPC address (repeat: runs are spread over them)",
    )
    p.add_argument("--model", default=None, help="the runs' model folder (default: bundled)")
    p.add_argument("--out", type=Path, required=True, help="JSON file of every run's indices")
    p.add_argument(
        "--into",
        type=Path,
        help="a sim/measured.json: each run's indices go into its entry with the run's salt",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (600)")
    a = p.parse_args(argv)

    runs = [json.loads(f.read_text()) for f in a.runs]
    # Prompts are built here, before the threads: a tokenizer is not shared across threads.
    tokenizer = PromptBuilder.from_model(str(resolve_model(a.model))).tok
    work = [
        (path, run, run_prompts(run, PromptBuilder(tokenizer, salt=run["replay"]["salt"])))
        for path, run in zip(a.runs, runs)
    ]
    results: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def worker(address: str, mine: list[tuple[Path, dict, Prompts]]) -> None:
        stub = pb_grpc.EngineStub(grpc.insecure_channel(address))
        for path, run, prompts in mine:
            started = time.perf_counter()
            try:
                indices = {
                    session: [first_text_index(stub, ids, n, a.timeout) for ids, n in requests]
                    for session, requests in prompts.items()
                }
            except grpc.RpcError as e:
                with lock:
                    errors.append(f"{path}: {e}")
                continue
            counts = collections.Counter(k for ks in indices.values() for k in ks)
            with lock:
                results[run["replay"]["salt"]] = {
                    "run": str(path),
                    "label": run["label"],
                    "first_visible": indices,
                }
                print(
                    f"{path}: {sum(counts.values())} requests, first visible token index "
                    f"{dict(sorted(counts.items()))} ({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )

    threads = [
        threading.Thread(target=worker, args=(address, work[i :: len(a.engine)]))
        for i, address in enumerate(a.engine)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    if a.into:
        measured = json.loads(a.into.read_text())
        for entry in measured:
            if entry.get("salt") in results:
                entry["first_visible"] = results[entry["salt"]]["first_visible"]
        a.into.write_text(json.dumps(measured, indent=1) + "\n")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
