"""Rotary timings with pytest-benchmark: every planned case, kernel and default implementation (see conftest.py)."""

from benchmarks import measured

KERNEL = "rotary"


def test_rotary(benchmark, bench_case, impl, bench_device):
    measured.time_case(benchmark, bench_case, impl, bench_device)
