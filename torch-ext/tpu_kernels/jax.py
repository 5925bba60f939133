"""The JAX API of tpu-kernels: plain JAX functions over the Pallas kernels (this module imports no torch).

Under jax.jit / jax.export they trace Mosaic kernels for the TPU; called eagerly on CPU arrays they run the same
kernels in Pallas' TPU interpret mode; to jit them for the CPU, call them inside `interpret_on_cpu()`.
"""
from ._pallas.common.interpret import interpret_on_cpu
from ._pallas.rms_norm.api import fused_add_rms_norm, rms_norm, rms_norm_backward

__all__ = ["fused_add_rms_norm", "interpret_on_cpu", "rms_norm", "rms_norm_backward"]
