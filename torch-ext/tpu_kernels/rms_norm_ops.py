"""Torch custom ops for RMSNorm (forward, fused residual-add forward) with autograd from the JAX api's vjp."""

import jax
import torch

from tpu_kernels_jax.rms_norm import api

from . import _torch_checks as checks
from ._op_registry import define_op


# The JAX functions the ops are made from. Annotations drive the torch schema (TorchTPU's jax_op convention).
def _rms_norm_jax(x: jax.Array, weight: jax.Array | None, eps: float, weight_offset: float) -> jax.Array:
    return api.rms_norm(x, weight, eps, weight_offset=weight_offset)


def _fused_add_rms_norm_jax(
    x: jax.Array, residual: jax.Array, weight: jax.Array | None, eps: float, weight_offset: float
) -> tuple[jax.Array, jax.Array]:
    return api.fused_add_rms_norm(x, residual, weight, eps, weight_offset=weight_offset)


def _fake_rms_norm(x, weight, eps, weight_offset):
    return torch.empty_like(x)


def _fake_fused(x, residual, weight, eps, weight_offset):
    return torch.empty_like(x), torch.empty_like(x)


rms_norm_op = define_op("rms_norm", _rms_norm_jax, _fake_rms_norm, grads=("x", "weight"))
fused_add_rms_norm_op = define_op(
    "fused_add_rms_norm", _fused_add_rms_norm_jax, _fake_fused, grads=("x", "residual", "weight")
)


def _validate(x, residual, weight, eps, weight_offset):
    checks.check_tensor("x", x)
    if residual is not None:
        checks.check_tensor("residual", residual, device=x.device)
    if weight is not None:
        checks.check_tensor("weight", weight, device=x.device)
    if not checks.tracing() and not checks.has_symbolic_shape(x, residual, weight):
        api.check_inputs(
            checks.placeholder("x", x),
            checks.placeholder("weight", weight),
            eps,
            weight_offset,
            residual=checks.placeholder("residual", residual),
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, weight_offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * (weight_offset + weight), math in f32.

    x: [..., hidden] float32/bfloat16/float16 on `tpu` or `cpu`; weight: [hidden] or None. Returns x's shape and
    dtype. Differentiable in x and weight.
    """
    _validate(x, None, weight, eps, weight_offset)
    return rms_norm_op(checks.contiguous(x), checks.contiguous(weight), float(eps), float(weight_offset))


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; residual has x's shape and dtype."""
    _validate(x, residual, weight, eps, weight_offset)
    return fused_add_rms_norm_op(
        checks.contiguous(x), checks.contiguous(residual), checks.contiguous(weight), float(eps), float(weight_offset)
    )
