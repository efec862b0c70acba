"""The roles an engine serves, as the engine reports them and the router
configures them."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"  # computes a prompt's KV and hands it to a decode engine
    DECODE = "decode"  # generates, pulling the prompt's KV from a prefill engine
    BOTH = "both"  # whole requests on one engine (aggregated, no P/D split)
