"""Paged attention timings with pytest-benchmark: every planned case, kernel and default implementation
(see conftest.py).
On a CPU only the small shapes are timed, the kernel in TPU interpret mode (never a TPU figure)."""

from benchmarks import measured

KERNEL = "paged_attention"


def test_paged_attention(benchmark, bench_case, impl, bench_device):
    measured.time_case(benchmark, bench_case, impl, bench_device)
