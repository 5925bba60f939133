"""RMSNorm timings with pytest-benchmark: every planned case, kernel and default implementation (see conftest.py)."""

from benchmarks import measured

KERNEL = "rms_norm"


def test_rms_norm(benchmark, bench_case, impl, bench_device):
    measured.time_case(benchmark, bench_case, impl, bench_device)
