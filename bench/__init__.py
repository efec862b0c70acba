"""Benchmarks for Tandem, run from a checkout (``python -m bench``; not part of
the installed package): the agentic replay's reports, sweeps and aiperf
cross-check (``bench.agentx``, over the product's replay client in
``tandem.workload``) and one module per measured question."""
