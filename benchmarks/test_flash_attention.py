"""Flash attention timings with pytest-benchmark: every planned case, kernel and default implementation (see
conftest.py). On a CPU no shape is small enough to time (32768 tokens each): the suite is modeled only there."""

from benchmarks import measured

KERNEL = "flash_attention"


def test_flash_attention(benchmark, bench_case, impl, bench_device):
    measured.time_case(benchmark, bench_case, impl, bench_device)
