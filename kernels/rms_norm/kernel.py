"""Pallas TPU kernels for RMSNorm: forward, fused residual-add forward, and backward.

Layout: the input is viewed as (rows, hidden); each grid step owns a (block_rows, hidden) slab, so the reduction over
`hidden` stays inside one block (a block as wide as the full hidden dimension is legal for any hidden size, which is
how sizes that are not a multiple of 128 are supported). The last slab may run past `rows`: Pallas clips its writes,
and the backward masks those rows out of the weight-gradient sum. Row blocks are independent ("parallel"), which lets
a multi-core chip split the grid.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.manual_axes import out_struct
from .tuning import RmsNormBlocks


def _scale(values, w_ref, weight_offset):
    """values * (weight_offset + w) for an f32 (rows, hidden) slab.

    The weight comes as (hidden / 128, 128) lane chunks when hidden is a multiple of 128: that is a free view of the
    [hidden] parameter, where a (1, hidden) operand costs XLA a relayout copy of the weight before every call. Chunk k
    scales lanes k * 128 .. k * 128 + 127 (whole vregs: no lane shifts). Other hidden sizes come as (1, hidden).
    """
    w = w_ref[...].astype(jnp.float32) + weight_offset
    chunks, lanes = w.shape
    if chunks == 1:
        return values * w
    return jnp.concatenate([values[:, k * lanes : (k + 1) * lanes] * w[k : k + 1] for k in range(chunks)], axis=-1)


def _normalize(s, w_ref, eps, weight_offset):
    """s: f32 slab. Returns (s * rstd * (offset + w), s * rstd) in f32."""
    normed = s * jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps)
    if w_ref is None:
        return normed, normed
    return _scale(normed, w_ref, weight_offset), normed


def _forward_kernel(*refs, eps, weight_offset, has_weight, has_residual):
    it = iter(refs)
    x_ref = next(it)
    residual_ref = next(it) if has_residual else None
    w_ref = next(it) if has_weight else None
    out_ref = next(it)
    sum_ref = next(it) if has_residual else None

    s = x_ref[...].astype(jnp.float32)
    if has_residual:
        # Round the sum to the input dtype first: it is what the unfused model stores and then normalises.
        rounded = (s + residual_ref[...].astype(jnp.float32)).astype(sum_ref.dtype)
        sum_ref[...] = rounded
        s = rounded.astype(jnp.float32)
    out, _ = _normalize(s, w_ref, eps, weight_offset)
    out_ref[...] = out.astype(out_ref.dtype)


def _row_spec(blocks: RmsNormBlocks, hidden: int):
    return pl.BlockSpec((blocks.block_rows, hidden), lambda i: (i, 0))


def _weight_spec(weight2d):
    return pl.BlockSpec(weight2d.shape, lambda i: (0, 0))  # the whole weight, the same block every step: fetched once


def _compiler_params(blocks: RmsNormBlocks):
    return pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=blocks.vmem_limit_bytes)


def _cost(rows, hidden, itemsize, streams, has_weight, flops_per_element):
    return pl.CostEstimate(
        flops=flops_per_element * rows * hidden,
        transcendentals=rows,
        bytes_accessed=streams * rows * hidden * itemsize + (hidden * 4 if has_weight else 0),
    )


def rms_norm_forward(x2d, weight2d, residual2d, *, eps, weight_offset, blocks: RmsNormBlocks):
    """x2d, residual2d: (rows, hidden); weight2d: the weight as api.weight_rows lays it out, or None. Returns out, or
    (out, sum) with a residual."""
    rows, hidden = x2d.shape
    has_weight = weight2d is not None
    has_residual = residual2d is not None
    operands = [x2d] + ([residual2d] if has_residual else []) + ([weight2d] if has_weight else [])
    in_specs = [_row_spec(blocks, hidden)] * (2 if has_residual else 1) + (
        [_weight_spec(weight2d)] if has_weight else []
    )
    out_shape = [out_struct((rows, hidden), x2d.dtype, operands)] * (2 if has_residual else 1)
    out_specs = [_row_spec(blocks, hidden)] * len(out_shape)
    kernel = functools.partial(
        _forward_kernel, eps=eps, weight_offset=weight_offset, has_weight=has_weight, has_residual=has_residual
    )
    streams = 4 if has_residual else 2
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(rows, blocks.block_rows),),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=_compiler_params(blocks),
        cost_estimate=_cost(rows, hidden, x2d.dtype.itemsize, streams, has_weight, 4),
        name="rms_norm_fwd",
    )(*operands)
    return tuple(outs) if has_residual else outs[0]


def _backward_kernel(*refs, eps, weight_offset, has_weight, has_sum_grad, rows, block_rows):
    it = iter(refs)
    s_ref = next(it)
    g_ref = next(it)
    gsum_ref = next(it) if has_sum_grad else None
    w_ref = next(it) if has_weight else None
    ds_ref = next(it)
    dw_ref = next(it) if has_weight else None

    s = s_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps)
    normed = s * rstd
    g_scaled = _scale(g, w_ref, weight_offset) if has_weight else g
    # d/ds of s * rstd(s): rstd * (g - normed * mean(g * normed)), with g already scaled by the weight.
    ds = rstd * (g_scaled - normed * jnp.mean(g_scaled * normed, axis=-1, keepdims=True))
    if has_sum_grad:
        ds = ds + gsum_ref[...].astype(jnp.float32)
    ds_ref[...] = ds.astype(ds_ref.dtype)
    if has_weight:
        # Rows past `rows` in the last slab hold whatever the buffer had; keep them out of the sum.
        row_ids = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
        contrib = jnp.where(row_ids < rows, g * normed, 0.0)
        dw_ref[...] = jnp.sum(contrib, axis=0, keepdims=True)[None]


def rms_norm_backward(s2d, g2d, gsum2d, weight2d, *, eps, weight_offset, blocks: RmsNormBlocks):
    """Gradients of rms_norm at s2d for output cotangent g2d (plus gsum2d, the cotangent of a fused sum output).

    Returns (ds in s2d.dtype, per-block weight-gradient partial sums (num_blocks, 1, hidden) in f32, or None).
    """
    rows, hidden = s2d.shape
    num_blocks = pl.cdiv(rows, blocks.block_rows)
    has_weight = weight2d is not None
    has_sum_grad = gsum2d is not None
    operands = [s2d, g2d] + ([gsum2d] if has_sum_grad else []) + ([weight2d] if has_weight else [])
    in_specs = [_row_spec(blocks, hidden)] * (3 if has_sum_grad else 2) + (
        [_weight_spec(weight2d)] if has_weight else []
    )
    out_shape = [out_struct((rows, hidden), s2d.dtype, operands)]
    out_specs = [_row_spec(blocks, hidden)]
    if has_weight:
        out_shape.append(out_struct((num_blocks, 1, hidden), jnp.float32, operands))
        out_specs.append(pl.BlockSpec((1, 1, hidden), lambda i: (i, 0, 0)))
    kernel = functools.partial(
        _backward_kernel,
        eps=eps,
        weight_offset=weight_offset,
        has_weight=has_weight,
        has_sum_grad=has_sum_grad,
        rows=rows,
        block_rows=blocks.block_rows,
    )
    streams = 4 if has_sum_grad else 3
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_blocks,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=_compiler_params(blocks),
        cost_estimate=_cost(rows, hidden, s2d.dtype.itemsize, streams, has_weight, 10),
        name="rms_norm_bwd",
    )(*operands)
    return outs[0], (outs[1] if has_weight else None)
