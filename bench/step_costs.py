"""An engine's step costs, measured the way the simulator prices them.

The simulator prices a vLLM scheduler step (``sim.costs.StepModel``) as a
fixed cost, plus for each prompt token computed ``token_s`` and
``token_ctx_s`` per token of context before it, plus for each decoding
sequence ``seq_s`` and ``seq_ctx_s`` per token of its context. A profile
taken under load (``tandem profile``) measures throughput at one mean prompt
and cannot tell a token's own cost from its context's; this bench measures
each term on one idle engine:

* **prefill**: one request at a time, ``T`` new prompt tokens after ``P``
  tokens already in the engine's prefix cache (the ``P``-token prefix is sent
  first, and the engine's ``cached_tokens`` must say so): the TTFT of a
  one-token Generate is the steps that compute ``T`` tokens after ``P``;
* **decode**: ``B`` requests at once, each after a ``C``-token prompt already
  cached, each generating ``--decode-tokens``: the inter-token latency of
  the batch once every request decodes.

Least squares gives the model's fields: prefill time = ``a + T × token_s +
T × (P + T/2) × token_ctx_s``; inter-token latency = ``step_s + B × seq_s +
B × C × seq_ctx_s``. The fit, every point with its fitted time, and the
command are printed and, with ``--out``, written as JSON that ``tandem sim
validate --step-model`` takes. One engine (vLLM CPU, the validation runs'
flags: SmolLM2 float32, block 128, ``--max-model-len`` 3072), bound to one
core. Usage:

    python -m bench.step_costs [--prefixes 0,512,1536,2560] [--tails 128,256,512,1024]
                               [--batches 1,2,4,8] [--contexts 256,2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench.engine_client import EngineClient, long_prompt
from bench.kvstore_bench import STOP_GRACE_S, start_engine
from bench.router_policies import MAX_MODEL_LEN
from bench.store_hits import BLOCK_TOKENS
from common.procs import Processes
from sim.defaults import STEP_MODEL_KIND


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def prefill_point(client: EngineClient, tokenizer, prefix: int, tail: int, seed: int) -> dict:
    """TTFT of ``tail`` new tokens after a ``prefix``-token cached prefix."""
    ids = long_prompt(tokenizer, prefix + tail, seed)
    if len(ids) < prefix + tail:
        raise RuntimeError(f"prompt of seed {seed}: {len(ids)} tokens, {prefix + tail} wanted")
    if prefix:
        client.generate(ids[:prefix], max_tokens=1)
    result = client.generate(ids, max_tokens=1)
    if result.cached_tokens != prefix:
        raise RuntimeError(
            f"prefix {prefix}, tail {tail}: the engine found {result.cached_tokens} tokens "
            "cached (a prefix not of whole blocks, or evicted)"
        )
    return {"prefix": prefix, "tail": tail, "seconds": result.seconds}


def decode_point(
    client: EngineClient, tokenizer, batch: int, context: int, tokens: int, seed: int
) -> dict:
    """Inter-token latency of ``batch`` requests decoding together after
    ``context``-token prompts already in the cache."""
    prompts = [long_prompt(tokenizer, context, seed + i) for i in range(batch)]
    for ids in prompts:
        client.generate(ids, max_tokens=1)

    def one(ids: list[int]) -> tuple[float, float]:
        start = time.perf_counter()
        result = client.generate(ids, max_tokens=tokens)
        return result.seconds, time.perf_counter() - start

    with ThreadPoolExecutor(batch) as pool:
        times = list(pool.map(one, prompts))
    # The requests start together (their prompts cached, one token each to
    # compute) and decode side by side to the end.
    itls = sorted((total - ttft) / (tokens - 1) for ttft, total in times)
    return {"batch": batch, "context": context, "itl_s": itls[len(itls) // 2]}


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a cost cannot be negative):
    the most negative coefficient is fixed at 0 and the rest refitted, until
    none is negative."""
    free = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while free:
        sub, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
        if (sub >= 0).all():
            coef[free] = sub
            break
        free.pop(int(np.argmin(sub)))
    return coef


def fit(prefill: list[dict], decode: list[dict]) -> dict:
    """The step model's fields by least squares over the points."""
    a = np.array([[1.0, p["tail"], p["tail"] * (p["prefix"] + p["tail"] / 2)] for p in prefill])
    y = np.array([p["seconds"] for p in prefill])
    fixed, token_s, token_ctx_s = nonnegative_lstsq(a, y)
    d = np.array([[1.0, p["batch"], p["batch"] * p["context"]] for p in decode])
    z = np.array([p["itl_s"] for p in decode])
    step_s, seq_s, seq_ctx_s = nonnegative_lstsq(d, z)
    for p, f in zip(prefill, a @ [fixed, token_s, token_ctx_s]):
        p["fitted_s"] = float(f)
    for p, f in zip(decode, d @ [step_s, seq_s, seq_ctx_s]):
        p["fitted_s"] = float(f)
    return {
        "step_s": float(step_s),
        "token_s": float(token_s),
        "token_ctx_s": float(token_ctx_s),
        "seq_s": float(seq_s),
        "seq_ctx_s": float(seq_ctx_s),
        "prefill_fixed_s": float(fixed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefixes", type=ints, default=[0, 512, 1536, 2560])
    parser.add_argument("--tails", type=ints, default=[128, 256, 512, 1024])
    parser.add_argument("--batches", type=ints, default=[1, 2, 4, 8])
    parser.add_argument("--contexts", type=ints, default=[256, 2048])
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="each point measured this often")
    parser.add_argument("--out", type=Path, help="write the fit and the points as JSON here")
    args = parser.parse_args(argv)
    for p in args.prefixes:
        if p % BLOCK_TOKENS:
            parser.error(f"prefix {p}: must be whole {BLOCK_TOKENS}-token blocks")
    from transformers import AutoTokenizer

    from common.model import resolve_model
    from services.stack import engine_cores

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    load_start = os.getloadavg()[0]
    started = datetime.now(UTC)
    prefill: list[dict] = []
    decode: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tandem-stepcosts-") as d:
        procs = Processes(Path(d))
        try:
            flags = ["--max-model-len", str(MAX_MODEL_LEN)]
            proc, client = start_engine(procs, "both", engine_cores(1)[0], "engine", flags)
            client.generate(long_prompt(tokenizer, 64, 1), max_tokens=4)  # warm-up
            seed = 10
            for _ in range(args.rounds):
                for prefix in args.prefixes:
                    for tail in args.tails:
                        if prefix + tail + 1 > MAX_MODEL_LEN:
                            continue
                        seed += 1
                        prefill.append(prefill_point(client, tokenizer, prefix, tail, seed))
                        print(f"prefill {prefill[-1]}", flush=True)
                for batch in args.batches:
                    for context in args.contexts:
                        seed += batch + 1
                        decode.append(
                            decode_point(
                                client, tokenizer, batch, context, args.decode_tokens, seed * 100
                            )
                        )
                        print(f"decode {decode[-1]}", flush=True)
            client.close()
            procs.stop(proc, STOP_GRACE_S)
        finally:
            procs.stop_all()
    model = fit(prefill, decode)
    load_end = os.getloadavg()[0]
    print(f"load average {load_start:.1f} → {load_end:.1f} (1 min)")
    print("prefill (prefix, tail): measured / fitted s")
    for p in prefill:
        print(f"  {p['prefix']:5d} {p['tail']:5d}: {p['seconds']:.3f} / {p['fitted_s']:.3f}")
    print("decode (batch, context): inter-token latency measured / fitted s")
    for p in decode:
        print(f"  {p['batch']:3d} {p['context']:5d}: {p['itl_s']:.4f} / {p['fitted_s']:.4f}")
    print("fit: " + ", ".join(f"{k} {v:.3g}" for k, v in model.items()))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "kind": STEP_MODEL_KIND,
                    "source": "measured",
                    "note": (
                        f"python -m bench.step_costs {' '.join(argv or sys.argv[1:])}; "
                        f"{started:%Y-%m-%d %H:%M} UTC, load average {load_start:.1f} → "
                        f"{load_end:.1f}; one vLLM CPU engine (SmolLM2-135M float32, one "
                        "core, block 128)"
                    ),
                    "model": model,
                    "prefill": prefill,
                    "decode": decode,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
