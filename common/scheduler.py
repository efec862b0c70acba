"""vLLM scheduler settings of one engine pool, under vLLM's own names.

Prefill, decode and aggregated pools do different work, so each gets its own
settings: a prefill pool that takes long fresh prompts wants their chunks
capped so short ones are not starved; a decode pool batches many sequences.
The embedded stack (`tandem up`) and, later, the operator's pool templates
both take these fields and pass them on as vLLM engine flags.

A field left at None keeps vLLM's default (the flag is not passed; each
field's help says what vLLM 0.32 then uses for an engine started as Tandem's
engine host starts it, on CPU and GPU alike).

vLLM's ``--prefill-schedule-interval`` is deliberately absent: vLLM 0.32 reads
it only in its data-parallel engine core for mixture-of-experts models
(``DPEngineCoreProc``), so on a single-rank engine it changes nothing.
"""

from __future__ import annotations

from argparse import ArgumentTypeError
from dataclasses import dataclass, field, fields
from typing import Any

from common.settings import parse_bool

POOLS = ("prefill", "decode", "aggregated")


def _setting(help: str) -> Any:
    return field(default=None, metadata={"help": help})


@dataclass(frozen=True)
class SchedulerSettings:
    long_prefill_token_threshold: int | None = _setting(
        "cap on the prompt tokens one request is scheduled per engine step while other "
        "requests are queued or running (0: no cap): a long fresh prefill then takes several "
        "steps and short requests get into each one; vLLM's default 0"
    )
    long_prefill_token_threshold_adaptive: bool | None = _setting(
        "raise that cap to a fair share of the step's token budget (max batched tokens / "
        "requests queued and running) where it is lower; vLLM's default false"
    )
    max_num_batched_tokens: int | None = _setting(
        "tokens one engine step processes at most (prefill chunks and decodes); vLLM's default 2048"
    )
    max_num_seqs: int | None = _setting(
        "sequences one engine step runs at most; vLLM's default 128"
    )

    def vllm_flags(self) -> list[str]:
        """The vLLM engine flags for what is set here."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            flag = flag_name(f.name)
            if isinstance(value, bool):
                argv.append(flag if value else f"--no-{flag[2:]}")
            else:
                argv += [flag, str(value)]
        return argv

    def problems(self, max_model_len: int) -> list[str]:
        """What is wrong with these settings for an engine of this context
        length, each naming the flag at fault (empty: nothing)."""
        found = []
        for name in ("long_prefill_token_threshold", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            least = 0 if name == "long_prefill_token_threshold" else 1
            if value is not None and value < least:
                found.append(f"{flag_name(name)} {value}: must be >= {least}")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and threshold > max_model_len:
            found.append(
                f"{flag_name('long_prefill_token_threshold')} {threshold}: above the "
                f"context length (--max-model-len {max_model_len})"
            )
        if self.long_prefill_token_threshold_adaptive and not threshold:
            found.append(
                f"{flag_name('long_prefill_token_threshold_adaptive')} needs "
                f"{flag_name('long_prefill_token_threshold')} > 0 (it raises that cap)"
            )
        batched, seqs = self.max_num_batched_tokens, self.max_num_seqs
        if batched is not None and seqs is not None and batched < seqs:
            found.append(
                f"{flag_name('max_num_batched_tokens')} {batched} is below "
                f"{flag_name('max_num_seqs')} {seqs}: every sequence needs at least "
                f"one token per step"
            )
        return found


SETTINGS = tuple(f.name for f in fields(SchedulerSettings))


def describe(setting: str) -> str:
    """What a setting does (for --help)."""
    return _field(setting).metadata["help"]


def is_boolean(setting: str) -> bool:
    """Whether a setting is on/off (its flag may stand alone) rather than a number."""
    return str(_field(setting).type).startswith("bool")


def flag_name(setting: str) -> str:
    """vLLM's flag for a setting: max_num_seqs → --max-num-seqs."""
    return "--" + setting.replace("_", "-")


def scheduler_flag(arg: str) -> str | None:
    """The scheduler flag an engine argument sets (`--max-num-seqs=8`, `--no-long-…`), if any."""
    name = arg.split("=", 1)[0].replace("_", "-")  # vLLM takes --max_num_seqs too
    if name.startswith("--no-"):
        name = "--" + name[len("--no-") :]
    return name if name in {flag_name(s) for s in SETTINGS} else None


def parse_per_pool(setting: str, text: str) -> dict[str, Any]:
    """A per-pool value of a setting: ``V`` for every pool, or
    ``POOL=V[,POOL=V…]``. Booleans take true/false (on/off, 1/0, yes/no).
    Errors name the flag and say what was expected."""
    flag = flag_name(setting)
    boolean = is_boolean(setting)

    def value(raw: str) -> Any:
        raw = raw.strip()
        if boolean:
            try:
                return parse_bool(raw)
            except ArgumentTypeError:
                raise ValueError(
                    f"{flag} {text!r}: {raw!r} is not true or false (POOL=true sets one pool)"
                ) from None
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {raw!r} is not an integer") from None

    if "=" not in text:
        return dict.fromkeys(POOLS, value(text))
    found: dict[str, Any] = {}
    for part in text.split(","):
        pool, sep, raw = part.partition("=")
        pool = pool.strip()
        if not sep or pool not in POOLS:
            raise ValueError(
                f"{flag} {text!r}: expected VALUE or POOL=VALUE[,POOL=VALUE…] "
                f"with POOL one of {', '.join(POOLS)}"
            )
        if pool in found:
            raise ValueError(f"{flag} {text!r}: pool {pool} given twice")
        found[pool] = value(raw)
    return found


def by_pool(values: dict[str, dict[str, Any]]) -> dict[str, SchedulerSettings]:
    """Settings per pool from values per setting ({setting: {pool: value}});
    only pools that have a value appear."""
    pools: dict[str, dict[str, Any]] = {}
    for setting, per_pool in values.items():
        for pool, value in per_pool.items():
            pools.setdefault(pool, {})[setting] = value
    return {pool: SchedulerSettings(**found) for pool, found in pools.items()}


def _field(setting: str) -> Any:
    for f in fields(SchedulerSettings):
        if f.name == setting:
            return f
    raise KeyError(f"no scheduler setting {setting!r} (settings: {', '.join(SETTINGS)})")
