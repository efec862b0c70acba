"""Engine profiles of this machine's CPU engines for the simulator, taken
with `tandem profile`.

    flock /work/engines.lock python -m bench.cpu_profile [--roles prefill,decode]
        [--prefill-levels 1,2,4] [--decode-levels 2,8,16] [--level-s 40]

One prefill and one decode engine configured as `bench.router_policies`
configures its engines for the runs `tandem sim validate` replays (the
stack's float32 vLLM flags, one core each, 1 GiB of KV, `--max-model-len`
3072, KV events, no store) behind a Tandem router with
``--remote-prefill-threshold 0`` (the P/D profiles' routing,
``PD_PROFILE_ROUTER_ARGS``); then `tandem profile --role prefill` and
`--role decode` against it, the `small` trace, think scale 0.2, as the
validation runs replay it (the decode profile with longer outputs). The
ConfigMaps go to ``--out`` (prefill.yaml, decode.yaml) with the levels'
runs; `cat` them into one file for `tandem sim validate --profiles`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import RESULTS, log
from bench.router_policies import KV_CACHE_GIB, MAX_MODEL_LEN
from common.ports import free_port
from operators.planner.profiling import PD_PROFILE_ROUTER_ARGS
from services.stack import Stack, StackConfig


def profile_role(
    role: str, url: str, levels: str, level_s: float, out: Path, trace_args: list[str]
) -> None:
    argv = [
        sys.executable,
        "-m",
        "tandem.profile",
        "--role",
        role,
        "--url",
        url,
        "--name",
        f"cpu-smollm2-{role}",
        "--hardware",
        "cpu-core",
        "--gpus-per-replica",
        "1",
        "--concurrencies",
        levels,
        "--level-s",
        str(level_s),
        "--think-scale",
        "0.2",
        "--no-progress",
        "--timeout",
        "300",
        "--out",
        str(out / f"{role}-runs"),
        "-o",
        str(out / f"{role}.yaml"),
        *trace_args,
    ]
    log("tandem profile " + " ".join(argv[3:]))
    subprocess.run(argv, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prefill-levels", default="1,2,4", help="prefill concurrencies")
    ap.add_argument("--decode-levels", default="2,8,16", help="decode concurrencies")
    ap.add_argument("--level-s", type=float, default=40.0, help="seconds per level")
    ap.add_argument("--sessions", type=int, default=16, help="sessions of the small trace")
    ap.add_argument("--roles", default="prefill,decode", help="the pools profiled, in turn")
    # The small trace's outputs (median 24, at most 128 tokens) leave the
    # decode engine idle behind the prefill engine: longer ones saturate it.
    ap.add_argument("--out-median", type=int, default=384, help="decode trace's median output")
    ap.add_argument("--out-max", type=int, default=512, help="decode trace's longest output")
    ap.add_argument("--out", help="output directory (default bench/results/<time>-cpu-profile)")
    a = ap.parse_args()
    out = Path(a.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-cpu-profile")
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    stack = Stack(
        StackConfig(
            prefill=1,
            decode=1,
            kv_store=False,
            kv_cache_gib=KV_CACHE_GIB,
            max_model_len=MAX_MODEL_LEN,
            router_port=port,
            router_args=list(PD_PROFILE_ROUTER_ARGS),
            state_dir=Path(tempfile.mkdtemp(prefix="tandem-cpu-profile-")),
        )
    )
    t0 = time.time()
    log(f"load average at start: {os.getloadavg()}")
    try:
        stack.start()
        log(f"engines up in {time.time() - t0:.0f} s; load average {os.getloadavg()}")
        url = f"http://127.0.0.1:{port}"
        trace = ["--sessions", str(a.sessions)]
        # The prompt plus its longest output within the engines' context,
        # with room for the chat template's tokens.
        longer = ["--out-median", str(a.out_median), "--out-max", str(a.out_max)]
        longer += ["--max-context", str(MAX_MODEL_LEN - 128)]
        for role, levels, args in (
            ("prefill", a.prefill_levels, trace),
            ("decode", a.decode_levels, [*trace, *longer]),
        ):
            if role in a.roles.split(","):
                profile_role(role, url, levels, a.level_s, out, args)
                log(f"load average after {role}: {os.getloadavg()}")
    finally:
        stack.stop()
    log(f"profiles in {out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
