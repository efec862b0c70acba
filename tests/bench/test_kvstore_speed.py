"""bench.kvstore_speed's own baselines (the store variants need a running store: the bench
itself checks every byte it gets back)."""

import pytest

from bench import kvstore_speed


def test_loopback_tcp_moves_every_byte_and_reports_a_rate():
    # bench_loopback_tcp compares the received buffer with the sent one and raises if
    # they differ; 3 MiB + 4 bytes is not a multiple of any socket buffer.
    gbps = kvstore_speed.bench_loopback_tcp((3 << 20) + 4, rounds=2)
    assert gbps > 0


def test_memcpy_reports_a_rate():
    assert kvstore_speed.bench_memcpy(1 << 20, rounds=2) > 0


def test_unknown_variant_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        kvstore_speed.main(["--variants", "tcp,carrier-pigeon"])
    assert exit_info.value.code == 2
    assert "carrier-pigeon" in capsys.readouterr().err
