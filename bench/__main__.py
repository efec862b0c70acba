"""``python -m bench``: the benchmarks' command line (``bench/cli.py``)."""

import sys

from bench.cli import main

sys.exit(main())
