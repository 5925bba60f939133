"""MoE experts_forward timings with pytest-benchmark: kernel and the XLA ragged_dot composition (see conftest.py).

On a TPU host only, `test_transformers_experts` also times transformers' default experts path on the `tpu` device
against our torch `experts_forward` (benchmarks/torch_moe.py); on a CPU it is skipped before torch is imported.
"""

import pytest

from benchmarks import measured

KERNEL = "moe"


def test_moe(benchmark, bench_case, impl, bench_device):
    measured.time_case(benchmark, bench_case, impl, bench_device)


@pytest.mark.parametrize("torch_impl", ["transformers default", "torch experts_forward"])
def test_transformers_experts(benchmark, bench_case, torch_impl, bench_device):
    if not bench_device.is_tpu:
        pytest.skip("device mode only: transformers' experts on the `tpu` device need a TPU")
    if bench_case.shape.dtype != "bfloat16":
        pytest.skip("bf16 weights only: transformers' default experts path takes no quantized weights")
    if dict(bench_case.shape.params).get("gate_layout", "concatenated") != "concatenated":
        pytest.skip(
            "Qwen3-style experts only: benchmarks/torch_moe.py builds a concatenated gate/up SiLU / GELU module"
        )
    from benchmarks import torch_moe  # imports torch / torch_tpu: only here, on a TPU host

    torch_moe.time_case(benchmark, bench_case, torch_impl, bench_device)
