"""The command-line flags of an agentic replay, shared by ``tandem profile`` and
the benchmarks (``python -m bench``): the trace (a file, or a seeded synthetic
one), the endpoint, the replay's pacing, and what they become (sessions, the
tokenizer, a ``ReplayConfig``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

DEFAULT_URL = "http://127.0.0.1:8000"


def add_gen_args(p: argparse.ArgumentParser, with_output: bool) -> None:
    from tandem.workload.generate import PROFILES

    g = p.add_argument_group("synthetic trace (when no --trace is given)")
    g.add_argument(
        "--profile",
        default="small",
        choices=sorted(PROFILES),
        help="parameter set: 'small' fits 2 CPU cores (contexts of a few thousand "
        "tokens); 'agentx' the published AgentX medians (default: small)",
    )
    g.add_argument("--sessions", type=int, help="number of sessions (small: 12)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--block-size", type=int, help="tokens per hash id (default 64)")
    g.add_argument("--turns-median", type=float, help="median main-agent turns per session")
    g.add_argument("--first-in-median", type=int, help="median first input, tokens")
    g.add_argument(
        "--shared-prefix",
        type=int,
        help="tokens shared by all sessions (tool definitions, system prompt)",
    )
    g.add_argument("--reuse", type=float, help="mean per-turn prefix reuse (0..1)")
    g.add_argument("--out-median", type=int, help="median output tokens")
    g.add_argument("--out-max", type=int, help="maximum output tokens")
    g.add_argument("--max-context", type=int, help="compaction threshold, tokens")
    g.add_argument("--subagent-share", type=float, help="share of sessions with sub-agents")
    g.add_argument("--subagents-median", type=int, help="sub-agents per fan-out (median)")
    g.add_argument("--think-median", type=float, help="median think time, seconds")
    if with_output:
        p.add_argument("-o", "--output", required=True, help="trace file to write (.jsonl)")


# Flags of add_gen_args, each named as its GenParams field.
GEN_FIELDS = (
    "sessions",
    "seed",
    "block_size",
    "turns_median",
    "first_in_median",
    "shared_prefix",
    "reuse",
    "out_median",
    "out_max",
    "max_context",
    "subagent_share",
    "subagents_median",
    "think_median",
)


def gen_params(a: argparse.Namespace):
    from tandem.workload.generate import params_for

    return params_for(a.profile, **{name: getattr(a, name) for name in GEN_FIELDS})


def add_replay_args(
    p: argparse.ArgumentParser, out_default: str, endpoint: bool = True, lanes: bool = True
) -> None:
    """The replay's flags; ``out_default`` says where results go without ``--out``."""
    p.add_argument(
        "--trace",
        help="trace file or directory (.jsonl/.json, AgentX format); "
        "without it a synthetic trace is generated",
    )
    if endpoint:
        p.add_argument(
            "--url",
            default=DEFAULT_URL,
            help=f"OpenAI-compatible base URL (default {DEFAULT_URL}, the router); "
            "several, comma-separated, take requests in turn (router "
            "replicas behind a per-request balancer)",
        )
        p.add_argument(
            "--model", help="model name to request (default: the first of GET /v1/models)"
        )
    p.add_argument(
        "--tokenizer",
        help="Hugging Face model folder whose tokenizer and chat "
        "template the server uses (default: Tandem's default "
        "model, SmolLM2-135M-Instruct)",
    )
    if lanes:
        p.add_argument(
            "-c", "--concurrency", type=int, default=4, help="concurrent session lanes (default 4)"
        )
    p.add_argument(
        "--think-scale",
        type=float,
        default=1.0,
        help="multiply trace think times (0 = none; default 1)",
    )
    p.add_argument("--think-max", type=float, help="cap each think time, seconds")
    p.add_argument("--max-tokens-cap", type=int, help="cap every request's max_tokens")
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (outputs may end before the trace's length)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    if lanes:
        p.add_argument(
            "--duration", type=float, help="stop starting requests after this many seconds"
        )
    p.add_argument("--max-sessions", type=int, help="replay only the first N sessions")
    p.add_argument(
        "--session-header",
        default="X-Session-ID",
        help="header carrying the session (and sub-agent) key; '' for none",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--no-verify", action="store_true", help="skip re-tokenizing every built prompt to check it"
    )
    p.add_argument("--out", help=f"output directory (default {out_default})")
    add_gen_args(p, with_output=False)


def load_sessions(a: argparse.Namespace):
    from tandem.workload import generate, trace

    if a.trace:
        sessions = trace.load(a.trace)
        info = {"path": str(a.trace)}
    else:
        p = gen_params(a)
        sessions = generate.generate(p)
        info = {
            "path": f"<generated profile={a.profile} seed={p.seed}>",
            "params": generate.params_dict(p),
        }
    if getattr(a, "max_sessions", None):
        sessions = sessions[: a.max_sessions]
    info["stats"] = generate.trace_stats(sessions)
    return sessions, info


def load_tokenizer(a: argparse.Namespace):
    from transformers import AutoTokenizer

    from common.model import resolve_model

    path = resolve_model(a.tokenizer)
    return AutoTokenizer.from_pretrained(str(path)), str(path)


def replay_config(a: argparse.Namespace, url: str = "", model: str = ""):
    from tandem.workload.replay import ReplayConfig

    concurrency = getattr(a, "concurrency", 1)
    if concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    return ReplayConfig(
        url=url.rstrip("/"),
        model=model,
        concurrency=concurrency,
        think_scale=a.think_scale,
        think_max=a.think_max,
        max_tokens_cap=a.max_tokens_cap,
        ignore_eos=not a.no_ignore_eos,
        timeout_s=a.timeout,
        duration_s=getattr(a, "duration", None),
        session_header=a.session_header,
        progress=not a.no_progress,
    )


def run_command(name: str, command: Callable[[], int]) -> int:
    """A replay command's exit status: its own, 2 for bad input (a trace, a
    value, a missing file), 1 for a run that failed (RuntimeError), 130 when
    interrupted; each error said on stderr after ``name``."""
    from tandem.workload.trace import TraceError

    try:
        return command()
    except (TraceError, ValueError, FileNotFoundError) as e:
        print(f"{name}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:
        print(f"{name}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr, flush=True)
        return 130
