"""The whole experts forward for a small batch in one Pallas kernel: no routing, no gather, no scatter.

With few tokens (decode at batch 1-16) the experts forward is a stream of expert weights from HBM, and the routing
around the grouped matmuls (sort, gathers, inverse permutation, weighted combine: ~18 small XLA ops of ~1.2 us each)
costs as much as a third of the weights' read time. Here every *touched* expert (touched.py lists them) runs over all
T tokens, and a token's result is kept with its routing weight when it chose that expert:

    out[t] = sum over touched e of c[t, e] * down_e(act(gate_e(x[t])) * up_e(x[t]))
    c[t, e] = sum over j of w[t, j] [idx[t, j] = e]

The extra MXU work (T rows per expert instead of the rows routed there) is free while T is small: each step's
matmuls take far less time than its weight block's DMA. Rows of tokens that did not choose the expert are selected
away (never multiplied by zero, so an overflow there cannot turn into NaN).

Grid (visit, chunk): visit v is touched expert experts[v] (a dynamic grid bound: the number touched, read from SMEM);
chunk c covers intermediate columns [c * tc, (c + 1) * tc) of that expert: the gate and up rows of the chunk and the
matching columns of down_proj, so act(gate) * up of the chunk goes straight into the down matmul and is never
written anywhere (an interleaved gate/up: the chunk's 2 * tc alternating rows, de-interleaved in VMEM after the
matmul, common.activation.deinterleaved_gating). Small chunks keep the first step's weight DMA (exposed: nothing to
overlap it with) short. Weights are read in the orientation XLA stores them
(ragged_dot.tuning.stored_minor_to_major_swapped); x, the routing and the f32 accumulator [T, H] stay in VMEM for the
whole call.

MXFP4 weights (gpt-oss), as mxfp4.prepare lays them out: gate/up blocks [E, H / 2, 2I] with scales [E, S(H), 2I]
(a chunk's columns on lanes, blocks and scales alike) and down blocks [E, I / 2, H] (a chunk's tc / 2 packed rows)
with the expert's scales [E, S(I), H] read whole (fetched once a visit; tc / 32 rows are no whole sublane tiles).
Each block is widened in VMEM by mxfp4.widen into 4 planes of the contraction dimension (k = 8i + 2p + h); x comes
in the planes' column order (mxfp4.plane_order, outside), and act(gate) * up [T, tc] meets down's planes through 4
one-hot selection matmuls [tc, tc / 4] (exact; the MXU's cost of a [tc, tc] weight, small beside the chunk's
3 * tc * H).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import mxfp4, quantization
from ..common.activation import apply_activation, apply_gating, deinterleaved_gating
from ..common.manual_axes import out_struct
from ..ragged_dot.kernel import matmul_precision
from . import touched


@dataclasses.dataclass(frozen=True)
class WeightStream:
    """How the kernel reads one weight operand (in its stored orientation): the axis holding the intermediate
    dimension (1: sublanes, 2: lanes), the block offset of this stream along it (the up half of a concatenated
    gate/up sits I / tc blocks in) and whether it holds gate and up interleaved (then a chunk's block is 2 * tc
    wide: its tc gate and tc up columns alternating)."""

    i_axis: int
    block_offset: int = 0
    interleaved: bool = False

    def width(self, tc: int) -> int:
        return 2 * tc if self.interleaved else tc


def _weight_spec(array_shape, stream: WeightStream, tc: int):
    hidden_axis = 3 - stream.i_axis
    block = [None, 0, 0]
    block[stream.i_axis] = stream.width(tc)
    block[hidden_axis] = array_shape[hidden_axis]

    def index(v, c, experts_ref, count_ref):
        idx = [experts_ref[v], 0, 0]
        idx[stream.i_axis] = c + stream.block_offset
        return tuple(idx)

    return pl.BlockSpec(tuple(block), index)


def _contract(a, block, a_axis, block_axis, compute_dtype):
    return jax.lax.dot_general(
        a.astype(compute_dtype),
        quantization.widen(block, compute_dtype),
        (((a_axis,), (block_axis,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=matmul_precision(compute_dtype),
    )


def _contract_planes(planes, lhs_planes, compute_dtype):
    """sum over p of lhs_planes(p) [T, K / 4] @ planes[p] [K / 4, C] (MXFP4: the 4 planes of `mxfp4.widen`), f32."""
    return sum(
        jax.lax.dot_general(
            lhs_planes(p),
            w,
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
            precision=matmul_precision(compute_dtype),
        )
        for p, w in enumerate(planes)
    )


def _chunk_rows(ref, c, chunks: int, rows: int):
    """Rows [c * rows, (c + 1) * rows) of `ref` [R, C] for chunk c, by selects over static slices (a chunk's MXFP4
    scale rows, tc / 32 of them, are not whole sublane tiles: gpt-oss's 2880 has no chunk of 256 multiples)."""
    out = ref[0:rows, :]
    for ci in range(1, chunks):
        out = jnp.where(c == ci, ref[ci * rows : (ci + 1) * rows, :], out)
    return out


SCALE_ROW_TILE = 8  # sublanes of an f32 tile: the scales' expert row is read from the aligned tile holding it


def _expert_row(ref, e, lanes: slice):
    """Expert e's row of the f32 scales `ref` [E8, N] (in VMEM, E8 a multiple of SCALE_ROW_TILE) at static lanes:
    the aligned 8-row tile holding row e is loaded and row e % 8 selected out of it (Mosaic on the v5e's libtpu
    rejects a one-row load at a dynamic, unaligned sublane index: "dynamic load with unaligned indices"). The select
    adds only zeros, so the row comes out exact."""
    base = pl.multiple_of((e // SCALE_ROW_TILE) * SCALE_ROW_TILE, SCALE_ROW_TILE)
    tile = ref[pl.ds(base, SCALE_ROW_TILE), lanes]
    sublane = jax.lax.broadcasted_iota(jnp.int32, tile.shape, 0)
    return jnp.sum(jnp.where(sublane == e % SCALE_ROW_TILE, tile, 0.0), axis=0, keepdims=True)


def _chunk_columns(ref, e, c, stream: WeightStream, chunks: int, width: int):
    """Columns [(c + offset) * width, ...) of expert e's row of the scales `ref` [E8, N] (all in VMEM), for chunk c:
    a chain of selects over static lane slices (Mosaic slices lanes at static offsets only, and a (1, width) block of
    its own would need width to be whole lane tiles, which would rule out chunks such as Gemma 4's 352 of I = 704)."""
    start = stream.block_offset * width
    out = _expert_row(ref, e, slice(start, start + width))
    for ci in range(1, chunks):
        lo = start + ci * width
        out = jnp.where(c == ci, _expert_row(ref, e, slice(lo, lo + width)), out)
    return out


def _rows_to_tile(scale):
    """[E, N] scales padded with rows up to a multiple of SCALE_ROW_TILE (a copy only where E is not one already:
    no model with such an expert count is known, but the kernel must read whole aligned tiles)."""
    pad = -scale.shape[0] % SCALE_ROW_TILE
    return scale if pad == 0 else jnp.pad(scale, ((0, pad), (0, 0)))


def _scaled(scale_row, weight_dtype):
    factor = quantization.widen_factor(weight_dtype)
    return scale_row if factor == 1.0 else scale_row * factor


def _fused_kernel(
    experts_ref,
    count_ref,
    x_ref,
    idx_ref,
    w_ref,
    *refs,
    up_streams,
    down_i_axis,
    num_up_scale,
    num_up_bias,
    has_down_scale,
    has_down_bias,
    chunks,
    activation,
    h_dtype,
    up_dtype,
    down_dtype,
    is_mxfp4=False,
):
    up_refs = refs[: len(up_streams)]
    rest = refs[len(up_streams) :]
    up_scale_refs = rest[:num_up_scale]
    rest = rest[num_up_scale:]
    up_bias_refs = rest[:num_up_bias]
    rest = rest[num_up_bias:]
    down_ref = rest[0]
    rest = rest[1:]
    down_scale_ref = rest[0] if has_down_scale else None
    rest = rest[has_down_scale:]
    select_ref = rest[0] if is_mxfp4 else None
    rest = rest[is_mxfp4:]
    down_bias_ref = rest[0] if has_down_bias else None
    out_ref, acc_ref, *exponent_ref = rest[has_down_bias:]
    v = pl.program_id(0)
    c = pl.program_id(1)
    e = experts_ref[v]
    last_visit = jnp.maximum(count_ref[0], 1) - 1

    @pl.when(jnp.logical_and(v == 0, c == 0))
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    chose = idx_ref[...] == e  # [T, k]
    coefficient = jnp.sum(jnp.where(chose, w_ref[...].astype(jnp.float32), 0.0), axis=1, keepdims=True)
    routed = jnp.max(jnp.where(chose, 1.0, 0.0), axis=1, keepdims=True) > 0.0  # [T, 1]

    x = x_ref[...]
    if is_mxfp4:
        # x [T, H] in the planes' column order (mxfp4.plane_order): plane p meets its H / 4 columns. Each stream's
        # block [H / 2, width] is widened whole along H with its e8m0 scales [S(H), width].
        quarter = x.shape[1] // 4
        xq = x.astype(up_dtype)
        parts = [
            _contract_planes(
                mxfp4.widen(r[...], sr[...], up_dtype), lambda p: xq[:, p * quarter : (p + 1) * quarter], up_dtype
            )
            for r, sr in zip(up_refs, up_scale_refs)
        ]
    else:
        # x [T, H] against a block with H on the axis other than the intermediate one.
        parts = [_contract(x, r[...], 1, 3 - s.i_axis - 1, up_dtype) for r, s in zip(up_refs, up_streams)]
    # Quantized weights: widened in VMEM by _contract, their per-column scale (times the widening's power of two) on
    # the f32 result, not on the block.
    if num_up_scale and not is_mxfp4:
        parts = [
            p * _scaled(_chunk_columns(up_scale_refs[0], e, c, s, chunks, p.shape[1]), up_refs[0].dtype)
            for p, s in zip(parts, up_streams)
        ]
    parts = [p + b[...].astype(jnp.float32) for p, b in zip(parts, up_bias_refs)] if num_up_bias else parts
    if up_streams[0].interleaved:
        h = deinterleaved_gating(parts[0], activation)
    elif len(parts) == 2:
        h = apply_gating(parts[0], parts[1], activation)
    else:
        h = apply_activation(parts[0], activation)
    # The grouped path writes act(gate) * up in the activations' dtype before the down matmul; so does this one.
    h = h.astype(h_dtype)
    if is_mxfp4:
        # The chunk's down_proj rows [tc / 2, H] (packed) widen to 4 planes of the chunk's intermediate columns
        # k = 8i + 2p + h'; h meets them in that column order through 4 one-hot selection matmuls [tc, tc / 4]
        # (exact: one product a column). The expert's e8m0 scales [S(I), H] arrive whole, as int32 in a scratch
        # from its first chunk on; each chunk selects its tc / 32 rows.
        rows = down_ref.shape[0] // 16

        @pl.when(c == 0)
        def _():
            exponent_ref[0][...] = down_scale_ref[...].astype(jnp.int32)

        planes = mxfp4.widen(down_ref[...], _chunk_rows(exponent_ref[0], c, chunks, rows), down_dtype)
        hd = h.astype(down_dtype)
        y = _contract_planes(
            planes,
            lambda p: jax.lax.dot_general(
                hd,
                select_ref[p],
                (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
                precision=matmul_precision(down_dtype),
            ).astype(down_dtype),
            down_dtype,
        )
    else:
        y = _contract(h, down_ref[...], 1, down_i_axis - 1, down_dtype)  # [T, H] f32
    if has_down_scale and not is_mxfp4:
        y = y * _scaled(_expert_row(down_scale_ref, e, slice(None)), down_ref.dtype)
    if has_down_bias:
        y = y + jnp.where(c == 0, 1.0, 0.0) * down_bias_ref[...].astype(jnp.float32)  # once per expert
    acc_ref[...] += jnp.where(routed, coefficient * y, 0.0)

    @pl.when(jnp.logical_and(v == last_visit, c == chunks - 1))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _plane_selection(tc: int, dtype):
    """[4, tc, tc / 4] one-hot: h [T, tc] @ out[p] is plane p's columns of h (mxfp4.plane_order's p-th quarter)."""
    return mxfp4.plane_order(jnp.eye(tc, dtype=dtype)).reshape(tc, 4, tc // 4).swapaxes(0, 1)


def experts_forward_small_batch(
    hidden_states,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    *,
    gate_up_scale=None,
    down_scale=None,
    up_streams,
    down_i_axis,
    tc,
    intermediate,
    activation,
    vmem_limit_bytes,
):
    """out [T, H] in hidden_states' dtype. gate_up / down are in their stored orientation, described by up_streams
    (one WeightStream per gate/up operand: two for a concatenated gate, one interleaved or without a gate) and
    down_i_axis; tc divides `intermediate`. Biases (or None): gate_up_bias [E, 1, N], down_bias [E, 1, H]. Validated
    by api.py and chosen by tuning.py. Quantized (int8 / float8_e4m3fn) weights come with f32 per-column scales
    gate_up_scale [E, N] and down_scale [E, H], each whole in VMEM (rows padded to a multiple of 8; read once a call:
    a per-expert [E, 1, N] view would cost XLA a relayout copy of each, ~7 us modeled v6e at Qwen3's sizes); their
    blocks are cast to the activations' dtype. MXFP4 (uint8) weights: both, in mxfp4.prepare's layout (up_streams on
    lanes, down_i_axis 1, tc a multiple of 64 or I), with their e8m0 scales gate_up_scale [E, S(H), N] and down_scale
    [E, S(I), H] (see the module docstring)."""
    tokens, hidden = hidden_states.shape
    num_experts = gate_up.shape[0]
    experts, count = touched.touched_experts(top_k_index, num_experts)
    chunks = intermediate // tc

    def whole(shape):
        return pl.BlockSpec(shape, lambda v, c, experts_ref, count_ref: (0,) * len(shape))

    is_mxfp4 = mxfp4.is_mxfp4(gate_up.dtype)
    x = mxfp4.plane_order(hidden_states) if is_mxfp4 else hidden_states
    in_specs = [whole(hidden_states.shape), whole(top_k_index.shape), whole(top_k_weights.shape)]
    operands = [x, top_k_index, top_k_weights]
    for s in up_streams:
        in_specs.append(_weight_spec(gate_up.shape, s, tc))
        operands.append(gate_up)
    if is_mxfp4:  # each stream's e8m0 scales [S(H), width], beside its block
        for s in up_streams:
            in_specs.append(_weight_spec(gate_up_scale.shape, s, tc))
            operands.append(gate_up_scale)
    elif gate_up_scale is not None:  # whole, fetched once; each step selects its expert's row and chunk's columns
        gate_up_scale = _rows_to_tile(gate_up_scale)
        in_specs.append(whole(gate_up_scale.shape))
        operands.append(gate_up_scale)
    if gate_up_bias is not None:
        for s in up_streams:
            in_specs.append(
                pl.BlockSpec(
                    (None, 1, s.width(tc)),
                    lambda v, c, experts_ref, count_ref, s=s: (experts_ref[v], 0, c + s.block_offset),
                )
            )
            operands.append(gate_up_bias)
    down_dtype = quantization.compute_dtype(hidden_states.dtype, down.dtype)
    scratch = [pltpu.VMEM((tokens, hidden), jnp.float32)]
    if is_mxfp4:  # packed rows [tc / 2, H] a chunk; the expert's scales [S(I), H] whole (fetched once an expert)
        in_specs.append(
            pl.BlockSpec((None, tc // 2, hidden), lambda v, c, experts_ref, count_ref: (experts_ref[v], c, 0))
        )
        in_specs.append(
            pl.BlockSpec(
                (None, down_scale.shape[1], hidden), lambda v, c, experts_ref, count_ref: (experts_ref[v], 0, 0)
            )
        )
        in_specs.append(whole((4, tc, tc // 4)))
        operands += [down, down_scale, _plane_selection(tc, down_dtype)]
        scratch.append(pltpu.VMEM(down_scale.shape[1:], jnp.int32))
    else:
        in_specs.append(_weight_spec(down.shape, WeightStream(down_i_axis), tc))
        operands.append(down)
        if down_scale is not None:
            down_scale = _rows_to_tile(down_scale)
            in_specs.append(whole(down_scale.shape))
            operands.append(down_scale)
    if down_bias is not None:
        in_specs.append(pl.BlockSpec((None, 1, hidden), lambda v, c, experts_ref, count_ref: (experts_ref[v], 0, 0)))
        operands.append(down_bias)
    # Each matmul in its operands' promoted dtype, as the grouped path's kernels do (an f32 down_proj stays f32;
    # quantized weights run in the activations' dtype).
    up_dtype = quantization.compute_dtype(hidden_states.dtype, gate_up.dtype)
    kernel = functools.partial(
        _fused_kernel,
        up_streams=tuple(up_streams),
        down_i_axis=down_i_axis,
        num_up_scale=len(up_streams) if is_mxfp4 else int(gate_up_scale is not None),
        num_up_bias=len(up_streams) if gate_up_bias is not None else 0,
        has_down_scale=down_scale is not None,
        has_down_bias=down_bias is not None,
        chunks=chunks,
        activation=activation,
        h_dtype=hidden_states.dtype,
        up_dtype=up_dtype,
        down_dtype=down_dtype,
        is_mxfp4=is_mxfp4,
    )
    touched_bound = min(num_experts, top_k_index.size)
    if is_mxfp4:  # packed blocks and their scales, as stored
        weight_bytes = touched_bound * sum(a.size // num_experts for a in (gate_up, gate_up_scale, down, down_scale))
    else:
        weight_bytes = (
            touched_bound * intermediate * hidden * (len(up_streams) * gate_up.dtype.itemsize + down.dtype.itemsize)
        )
    cost = pl.CostEstimate(
        flops=2 * touched_bound * tokens * hidden * intermediate * (len(up_streams) + 1),
        transcendentals=touched_bound * tokens * intermediate,
        bytes_accessed=weight_bytes + 2 * hidden_states.size * hidden_states.dtype.itemsize,
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((tokens, hidden), hidden_states.dtype, experts, count, operands),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(jnp.maximum(count, 1), chunks),
            in_specs=in_specs,
            out_specs=whole((tokens, hidden)),
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=cost,
        name="moe_experts_small_batch",
    )(experts, count.reshape(1), *operands)
