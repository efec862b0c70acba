"""Chat templates the router ships, for models whose own template lacks a
feature (``--chat-template``)."""

from pathlib import Path

# ChatML (SmolLM2's format) with Hermes-style tool calls: the bundled model's
# own template ignores `tools`. Parse its output with `--tool-call-parser hermes`.
CHATML_TOOLS = Path(__file__).resolve().parent / "chatml_tools.jinja"
