"""Torch custom ops for RMSNorm (forward, fused residual-add forward, backward) and their autograd."""

import jax
import jax.numpy as jnp
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


def _rms_norm_backward_jax(
    grad: jax.Array,
    x: jax.Array,
    weight: jax.Array | None,
    grad_sum: jax.Array | None,
    eps: float,
    weight_offset: float,
) -> tuple[jax.Array, jax.Array]:
    dx, dweight = api.rms_norm_backward(grad, x, weight, eps, weight_offset=weight_offset, grad_sum=grad_sum)
    # A torch op returns tensors: no weight gives an empty weight gradient.
    return dx, (jnp.zeros((0,), jnp.float32) if dweight is None else dweight)


def _fake_rms_norm(x, weight, eps, weight_offset):
    return torch.empty_like(x)


def _fake_fused(x, residual, weight, eps, weight_offset):
    return torch.empty_like(x), torch.empty_like(x)


def _fake_backward(grad, x, weight, grad_sum, eps, weight_offset):
    dweight = x.new_empty((0,), dtype=torch.float32) if weight is None else torch.empty_like(weight)
    return torch.empty_like(x), dweight


rms_norm_op = define_op("rms_norm", _rms_norm_jax, _fake_rms_norm)
fused_add_rms_norm_op = define_op("fused_add_rms_norm", _fused_add_rms_norm_jax, _fake_fused)
rms_norm_backward_op = define_op("rms_norm_backward", _rms_norm_backward_jax, _fake_backward)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, eps, weight_offset = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.weight_offset = eps, weight_offset


def _backward_rms_norm(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(grad.contiguous(), x, weight, None, ctx.eps, ctx.weight_offset)
    return dx, (dweight if weight is not None else None), None, None


def _setup_fused(ctx, inputs, output):
    x, residual, weight, eps, weight_offset = inputs
    ctx.save_for_backward(output[1], weight)  # the rounded sum is what the norm saw
    ctx.eps, ctx.weight_offset = eps, weight_offset


def _backward_fused(ctx, grad_out, grad_sum):
    total, weight = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(
        grad_out.contiguous(), total, weight, grad_sum.contiguous(), ctx.eps, ctx.weight_offset
    )
    return dx, dx, (dweight if weight is not None else None), None, None


rms_norm_op.register_autograd(_backward_rms_norm, setup_context=_setup_rms_norm)
fused_add_rms_norm_op.register_autograd(_backward_fused, setup_context=_setup_fused)


def _validate(x, residual, weight, eps, weight_offset):
    checks.check_tensor("x", x)
    if residual is not None:
        checks.check_tensor("residual", residual, device=x.device)
    if weight is not None:
        checks.check_tensor("weight", weight, device=x.device)
    if not checks.has_symbolic_shape(x, residual, weight):
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
    return rms_norm_op(x.contiguous(), weight, float(eps), float(weight_offset))


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
    return fused_add_rms_norm_op(x.contiguous(), residual.contiguous(), weight, float(eps), float(weight_offset))
