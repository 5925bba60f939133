"""Public JAX API of RMSNorm: input validation, block choice, and custom_vjp wiring of the Pallas kernels.

Every op takes `blocks=` (an RmsNormBlocks: the row block and the VMEM limit), checked before anything is traced;
None means the tuning table's. The blocks are static: a gradient runs the backward kernel with the blocks its forward
was given.
"""

import functools
import math

import jax
import jax.numpy as jnp

from ..common import chip
from ..common.interpret import interpret_eager_cpu_calls
from ..common.manual_axes import cotangent_like
from ..common.validation import FLOAT_DTYPES, check_array, check_finite, check_finite_nonnegative
from . import kernel, tuning
from .tuning import RmsNormBlocks

# Row streams of the widest kernel (the fused forward: x, residual, out, sum; the fused backward: s, g, g_sum, ds):
# one block size serves the forward, the fused forward and the backward, sized for it.
STREAMS = 4
LANES = 128  # a vreg's lanes: the weight's chunk width (see _weight_rows)


def check_inputs(x, weight, eps, weight_offset, residual=None):
    """Validate rms_norm / fused_add_rms_norm arguments (arrays or ShapeDtypeStructs); return (eps, weight_offset)."""
    dtype = check_array("x", x, min_ndim=1)
    hidden = x.shape[-1]
    if hidden == 0:
        raise ValueError(f"x: expected a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    if residual is not None:
        check_array("residual", residual, dtypes=(dtype,))
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"residual: expected the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if weight is not None:
        check_array("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
        if weight.shape[0] != hidden:
            raise ValueError(f"weight: expected shape ({hidden},) to match x's hidden size, got {tuple(weight.shape)}")
    return check_finite_nonnegative("eps", eps), check_finite("weight_offset", weight_offset)


def _kernel_dtype(dtype):
    """The dtype the kernels run in (see _as_rows)."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def tuning_arguments(x) -> dict:
    """The shape arguments of tuning.choose_blocks / candidate_blocks for an op on x (an array or ShapeDtypeStruct
    [..., hidden]): the rows of its (rows, hidden) view, in the dtype the kernels run in."""
    hidden = x.shape[-1]
    return dict(rows=math.prod(x.shape[:-1]), hidden=hidden, dtype=_kernel_dtype(x.dtype), streams=STREAMS)


def _blocks(blocks, x) -> RmsNormBlocks | None:
    """The checked blocks for an op on x (None for an empty x, which launches no kernel)."""
    tuning.check_blocks_type(blocks)
    if x.size == 0:
        return None
    return tuning.resolve_blocks(blocks, **tuning_arguments(x), info=chip.current_tpu_info())


def _weight_grad(partials, weight2d):
    if weight2d is None:
        return None
    return cotangent_like(partials.sum(axis=(0, 1)).reshape(weight2d.shape).astype(weight2d.dtype), weight2d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm_2d(x2d, weight2d, eps, weight_offset, blocks):
    return kernel.rms_norm_forward(x2d, weight2d, None, eps=eps, weight_offset=weight_offset, blocks=blocks)


def _rms_norm_2d_fwd(x2d, weight2d, eps, weight_offset, blocks):
    return _rms_norm_2d(x2d, weight2d, eps, weight_offset, blocks), (x2d, weight2d)


def _rms_norm_2d_bwd(eps, weight_offset, blocks, saved, g):
    x2d, weight2d = saved
    dx, partials = kernel.rms_norm_backward(x2d, g, None, weight2d, eps=eps, weight_offset=weight_offset, blocks=blocks)
    return dx, _weight_grad(partials, weight2d)


_rms_norm_2d.defvjp(_rms_norm_2d_fwd, _rms_norm_2d_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused_add_rms_norm_2d(x2d, residual2d, weight2d, eps, weight_offset, blocks):
    return kernel.rms_norm_forward(x2d, weight2d, residual2d, eps=eps, weight_offset=weight_offset, blocks=blocks)


def _fused_fwd(x2d, residual2d, weight2d, eps, weight_offset, blocks):
    out, total = _fused_add_rms_norm_2d(x2d, residual2d, weight2d, eps, weight_offset, blocks)
    return (out, total), (total, weight2d)


def _fused_bwd(eps, weight_offset, blocks, saved, cotangents):
    total, weight2d = saved
    g_out, g_sum = cotangents
    ds, partials = kernel.rms_norm_backward(
        total, g_out, g_sum, weight2d, eps=eps, weight_offset=weight_offset, blocks=blocks
    )
    return ds, ds, _weight_grad(partials, weight2d)


_fused_add_rms_norm_2d.defvjp(_fused_fwd, _fused_bwd)


def _as_rows(a, hidden):
    """(rows, hidden) view for the kernels. float16 goes through the kernels as float32: Mosaic (libtpu 0.0.50) does
    not lower float16 vector loads, and TPUs have no float16 arithmetic; the cast back rounds once, as f32 math does."""
    a = a.reshape(-1, hidden)
    return a.astype(jnp.float32) if a.dtype == jnp.float16 else a


def _weight_rows(weight, hidden):
    """The weight as the kernels take it: (hidden / 128, 128) lane chunks when hidden is a multiple of 128, a free
    view of the [hidden] parameter on TPU, where (1, hidden) is a relayout XLA copies before each call (1.3 µs, modeled
    v6e, each of a decode step's norms); (1, hidden) otherwise. float16 as float32, as _as_rows does."""
    lanes = LANES if hidden % LANES == 0 else hidden
    return _as_rows(weight, lanes)


@interpret_eager_cpu_calls
def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    blocks: RmsNormBlocks | None = None,
) -> jax.Array:
    """RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * (weight_offset + weight), math in f32.

    x: [..., hidden] in f32, bf16 or f16; weight: [hidden] or None (no scale); returns x's shape and dtype.
    `weight_offset=1.0` gives Gemma's (1 + weight) convention. Differentiable in x and weight (the backward kernel
    runs with the same blocks). blocks: the tiling (RmsNormBlocks), None for the tuning table's.
    """
    eps, weight_offset = check_inputs(x, weight, eps, weight_offset)
    blocks = _blocks(blocks, x)
    hidden = x.shape[-1]
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)
    w2d = None if weight is None else _weight_rows(weight, hidden)
    return _rms_norm_2d(_as_rows(x, hidden), w2d, eps, weight_offset, blocks).reshape(x.shape).astype(x.dtype)


@interpret_eager_cpu_calls
def fused_add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    blocks: RmsNormBlocks | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(rms_norm(x + residual), x + residual) in one pass over HBM; the sum is rounded to x.dtype before the norm.

    residual must have x's shape and dtype. Differentiable in x, residual and weight (the backward kernel runs with
    the same blocks). blocks: the tiling (RmsNormBlocks), None for the tuning table's.
    """
    eps, weight_offset = check_inputs(x, weight, eps, weight_offset, residual=residual)
    blocks = _blocks(blocks, x)
    hidden = x.shape[-1]
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype), jnp.zeros(x.shape, x.dtype)
    w2d = None if weight is None else _weight_rows(weight, hidden)
    out, total = _fused_add_rms_norm_2d(
        _as_rows(x, hidden), _as_rows(residual, hidden), w2d, eps, weight_offset, blocks
    )
    return out.reshape(x.shape).astype(x.dtype), total.reshape(x.shape).astype(x.dtype)


@interpret_eager_cpu_calls
def rms_norm_backward(
    grad: jax.Array,
    x: jax.Array,
    weight: jax.Array | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    grad_sum: jax.Array | None = None,
    blocks: RmsNormBlocks | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gradients (d x, d weight) of rms_norm(x, weight, eps) for output cotangent `grad`.

    For fused_add_rms_norm pass x = the saved sum and grad_sum = the cotangent of the sum output; d x is then the
    gradient for both x and residual. d weight is None when weight is None. blocks: the tiling (RmsNormBlocks), None
    for the tuning table's.
    """
    eps, weight_offset = check_inputs(x, weight, eps, weight_offset)
    check_array("grad", grad, dtypes=None)
    if tuple(grad.shape) != tuple(x.shape):
        raise ValueError(f"grad: expected the shape of x {tuple(x.shape)}, got {tuple(grad.shape)}")
    if grad_sum is not None and tuple(grad_sum.shape) != tuple(x.shape):
        raise ValueError(f"grad_sum: expected the shape of x {tuple(x.shape)}, got {tuple(grad_sum.shape)}")
    blocks = _blocks(blocks, x)
    hidden = x.shape[-1]
    if x.size == 0:
        dw = None if weight is None else jnp.zeros(weight.shape, weight.dtype)
        return jnp.zeros(x.shape, x.dtype), dw
    w2d = None if weight is None else _weight_rows(weight, hidden)
    gsum2d = None if grad_sum is None else _as_rows(grad_sum, hidden)
    x2d = _as_rows(x, hidden)
    dx, partials = kernel.rms_norm_backward(
        x2d, _as_rows(grad, hidden), gsum2d, w2d, eps=eps, weight_offset=weight_offset, blocks=blocks
    )
    dweight = _weight_grad(partials, w2d)
    return dx.reshape(x.shape).astype(x.dtype), (
        None if dweight is None else dweight.reshape(weight.shape).astype(weight.dtype)
    )
