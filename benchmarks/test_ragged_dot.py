"""Ragged dot (MoE grouped matmuls) timings with pytest-benchmark: kernel and XLA ragged_dot (see conftest.py)."""

from benchmarks import measured

KERNEL = "ragged_dot"


def test_ragged_dot(benchmark, bench_case, impl, bench_device):
    measured.time_case(benchmark, bench_case, impl, bench_device)
