"""Roofline: the least time one call can take on a chip, from the bytes it must move and the matmul flops it must
do (chip parameters from `perf_model.get_chip`, i.e. jax's `get_tpu_info_for_chip`)."""


def roofline_s(hbm_bytes: int, mxu_flops: int, chip) -> float:
    return max(hbm_bytes / chip.hbm_bytes_per_s, mxu_flops / chip.bf16_flops_per_s)


def bound(hbm_bytes: int, mxu_flops: int, chip) -> str:
    return "hbm" if hbm_bytes / chip.hbm_bytes_per_s >= mxu_flops / chip.bf16_flops_per_s else "compute"
