"""Agentic workload benchmark in the AgentX / kv-cache-tester trace format.

The trace format, the synthetic generator, the prompt builder, the replay
client and the metrics live in ``tandem.workload`` (``tandem profile`` replays
the same traces); what only the benchmarks need is here:

* ``report``     -- Markdown report and plots from run files.
* ``sweep``      -- several concurrencies x several endpoints, ratios vs a baseline.
* ``crosscheck`` -- the same requests replayed by aiperf, compared with ours.
* ``embedded``   -- the embedded stack as aggregated and as P/D, replayed and compared.
"""
