"""What the product says where the benchmarks left it: `tandem bench` points
at `python -m bench`, and the launcher imports nothing of `bench`. Real
processes, no engines."""

from __future__ import annotations

import subprocess
import sys

from tandem.cli import main


def test_tandem_bench_says_where_the_benchmarks_went(capsys):
    assert main(["bench", "replay", "--help"]) == 2
    err = capsys.readouterr().err
    assert "python -m bench" in err and "tandem profile" in err


def test_the_launcher_and_the_profiler_load_no_benchmark_module():
    code = ("import sys, tandem.cli, tandem.profile\n"
            "print(sorted(m for m in sys.modules if m == 'bench' or m.startswith('bench.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_profile_help_is_its_own(capsys):
    try:
        main(["profile", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tandem profile") and "--role" in out
    assert "--kv-capacity-tokens" in out and "~/.cache/tandem/profiles" in out
