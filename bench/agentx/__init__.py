"""Agentic workload benchmark in the AgentX / kv-cache-tester trace format.

Modules, from data to report:

* ``trace``    -- the trace format: read, validate, write.
* ``generate`` -- seeded synthetic traces with agentic statistics.
* ``content``  -- prompts whose tokens reproduce a trace's block-hash structure.
* ``replay``   -- the asyncio replay client (lanes, think time, sub-agents).
* ``metrics``  -- summary statistics from per-request records (pure functions).
* ``report``   -- JSON results, Markdown report and plots.
* ``sweep``    -- several concurrencies x several endpoints, ratios vs a baseline.
* ``crosscheck`` -- the same requests replayed by aiperf, compared with ours.
"""
