"""The agentic workload in the AgentX / kv-cache-tester trace format, and the
client that replays it: what ``tandem profile`` drives a pool with, and what
the benchmarks (``bench/``) build on.

Modules, from data to results:

* ``trace``    -- the trace format: read, validate, write.
* ``generate`` -- seeded synthetic traces with agentic statistics.
* ``content``  -- prompts whose tokens reproduce a trace's block-hash structure.
* ``endpoint`` -- the OpenAI endpoint: base URLs, the served model, SSE lines.
* ``replay``   -- the asyncio replay client (lanes, think time, sub-agents).
* ``metrics``  -- summary statistics from per-request records (pure functions).
* ``runs``     -- a replay's run file (``run.json``).
* ``args``     -- the command-line flags of a replay.
"""
