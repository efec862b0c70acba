"""Benchmarks for Tandem: the agentic workload replay (``bench.agentx``) and its CLI
(``bench.cli``, wired as ``tandem bench``)."""
