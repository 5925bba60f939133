"""KV cache write timings with pytest-benchmark: every planned case, kernel and default implementation
(see conftest.py).
On a CPU only the small shapes are timed, the kernel in TPU interpret mode (never a TPU figure)."""

from benchmarks import measured

KERNEL = "kv_cache"


def test_kv_cache(benchmark, bench_case, impl, bench_device):
    measured.time_case(benchmark, bench_case, impl, bench_device)
