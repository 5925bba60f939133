"""When experts_forward takes the fused small-batch kernel (small_batch.py), and with which chunk of the
intermediate dimension; None sends a call down the grouped-matmul path.

The small-batch kernel multiplies every touched expert by all T tokens, so it wins while that extra MXU work hides
under the weights' DMA: the routing ops it removes cost a fixed ~20 us, and its MXU work grows with T.
SMALL_BATCH_MAX_TOKENS is the largest decode batch where it is faster than the grouped path at both benchmark
models (benchmarks/ops/moe.py: Qwen3-30B-A3B and Gemma 4 26B-A4B shapes, random top-8 of 128, bf16). Measured on the
v5e (device time): up to 128 tokens (1,602 / 2,020 us vs the grouped path's 1,660 / 2,093); at 256 the grouped path
ties on Qwen3 (1,684 vs 1,685) and wins on Gemma 4 (2,148 vs 2,244). Modeled: v6e wins at every batch up to 256
(B = 256: 98.9 / 99.0 % of the HBM roofline vs 84.5 / 84.9 %; at 512 it loses, 81.2 / 56.9 % vs 84.8 / 83.1 %: the
MXU work on unrouted tokens no longer hides under the DMA); v5e up to 128 (as measured); v7x up to 64 (at 128 it is
80.8 / 80.4 % vs 79.1 / 81.2 %: a draw).

The chunk tc: the largest legal one whose weight blocks (gate, up and down columns of the chunk) stay within
STEP_BYTES. The first block's DMA has nothing to overlap with and is paid in full, so blocks should not be large;
but narrow chunks use the MXU badly (Gemma 4's I = 704 in chunks of 88 columns: 89 % of the roofline at B = 64,
in chunks of 176: 98 %; modeled v6e). 4 MiB gives 256-column chunks for Qwen3 (2048 hidden) and 176 for Gemma 4.
"""

import dataclasses
import typing

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ..common import chip, mxfp4
from ..common.blocks import LANES, check_tile, check_vmem_fit, sublane_multiple
from ..common.quantization import is_quantized
from ..ragged_dot import tuning as ragged_dot_tuning
from ..ragged_dot.tuning import RaggedDotBlocks
from . import combine
from .small_batch import WeightStream

SMALL_BATCH_MAX_TOKENS = {"v5e": 128, "v6e": 256, "v7x": 64}
# touched.py builds [E, E] matrices in VMEM: E = 4096 overflows v7x's scoped VMEM; 1024 compiles everywhere (test).
SMALL_BATCH_MAX_EXPERTS = 1024
STEP_BYTES = 4 << 20
# MXFP4 weights: a step's packed bytes. Wide chunks amortize the widening's per-step costs (modeled v6e, gpt-oss-20b
# at B = 8: chunks of 960 columns, 4.3 MB a step, 374.3 us; 576 415.0; 320 501.9; the grouped path 388.4), so where
# the VMEM share does not hold this chunk (v7x, or many tokens) the table takes the grouped path.
MXFP4_STEP_BYTES = 8 << 20
VMEM_SHARE = 0.35
F32_TEMPORARIES = 3


PATHS = ("small_batch", "grouped")
COMBINES = ("kernel", "gather")
# The grouped path's combine (each token's k weighted rows summed): "kernel" is combine.py's row-DMA kernel, "gather"
# XLA's row gather + sum. Measured on the v5e (device time), Qwen3's rows of 2048 bf16: at 4096 tokens (32,768 rows,
# 128 MiB) XLA's gather + sum 1,333 us, the kernel 442 us (its copies issued in ~11 bundles a row); at 512 tokens
# (4,096 rows, 16 MiB) XLA's took 38 us, its table held in VMEM, and the kernel's ~4k row copies cost more
# (experts_forward ~1,850 -> 1,944 us, at 26 bundles a copy). So the kernel takes rows of more than
# COMBINE_KERNEL_MIN_BYTES, where the table chooses it (the crossover between the two sizes is unmeasured). v6e: the
# same single-core kernel and XLA gather, not measured; v7x keeps XLA's gather, which can use both of its
# TensorCores, where the kernel runs its steps on one.
COMBINE = {"v5e": "kernel", "v6e": "kernel", "v7x": "gather"}
COMBINE_KERNEL_MIN_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class ExpertsBlocks:
    """`blocks=` of experts_forward: which path runs and the tiles of each. None anywhere is the tuning table's
    choice, so `ExpertsBlocks()` is the table.

    path              "small_batch" (one kernel: every touched expert over all tokens, small_batch.py), "grouped"
                      (route, gate/up and down grouped matmuls, combine) or None: the small-batch kernel up to
                      SMALL_BATCH_MAX_TOKENS tokens on the generation when it can serve the inputs, else grouped.
    chunk             small-batch kernel: intermediate columns per grid step (of each of gate, up and down): a divisor
                      of I that is whole layout tiles (128 lanes, or sublanes, on the axis the stored weights hold I
                      on); only with path="small_batch".
    vmem_limit_bytes  the small-batch kernel's scoped VMEM; only with path="small_batch".
    gate_up, down     the RaggedDotBlocks of the grouped path's two grouped matmuls (gate/up with act(gate) * up
                      fused; down with the routing weights as row scale). They also serve the backward of both paths:
                      the small-batch kernel's gradient is the grouped path's.
    combine           the grouped path's combine: "kernel" (combine.py: one row DMA a (token, slot) pair, summed in
                      VMEM), "gather" (XLA's row gather and sum) or None: the table's (COMBINE).
    """

    path: str | None = None
    chunk: int | None = None
    vmem_limit_bytes: int | None = None
    gate_up: RaggedDotBlocks | None = None
    down: RaggedDotBlocks | None = None
    combine: str | None = None

    def to_dict(self) -> dict:
        """These blocks as nested dicts of plain values (None fields stay None), e.g. to cross as JSON."""
        return _to_dict(self)

    @classmethod
    def from_dict(cls, value: dict | None) -> "ExpertsBlocks | None":
        """The inverse of to_dict; None stays None (the tuning table). Missing keys are None."""
        return _from_dict(cls, value)


def _to_dict(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _from_dict(cls, value):
    """A dict back into the dataclass `cls`, each field a nested dataclass where its annotation names one."""
    if value is None:
        return None
    hints = typing.get_type_hints(cls)
    fields = {}
    for field in dataclasses.fields(cls):
        part = next((t for t in typing.get_args(hints[field.name]) if dataclasses.is_dataclass(t)), None)
        item = value.get(field.name)
        fields[field.name] = _from_dict(part, item) if part is not None and isinstance(item, dict) else item
    return cls(**fields)


def combine_choice(blocks: ExpertsBlocks, rows: int, hidden: int, dtype) -> str:
    """The grouped path's combine of `rows` down-projection rows of `hidden` in `dtype`: blocks.combine (the kernel
    where it can serve them, else a ValueError naming the field), else the table's for the chip in use (XLA's gather
    up to COMBINE_KERNEL_MIN_BYTES, and for rows the kernel cannot serve)."""
    why = combine.unsupported(dtype, rows)
    if blocks.combine is not None:
        if blocks.combine == "kernel" and why:
            raise ValueError(f"blocks.combine: 'kernel' cannot serve these inputs: {why}")
        return blocks.combine
    if why or rows * hidden * jnp.dtype(dtype).itemsize <= COMBINE_KERNEL_MIN_BYTES:
        return "gather"
    return COMBINE.get(chip.generation_name(chip.current_tpu_info()), "gather")


@dataclasses.dataclass(frozen=True)
class SmallBatchPlan:
    swap_gate_up: bool  # read gate_up through swapaxes(1, 2): its stored orientation
    swap_down: bool
    up_streams: tuple[WeightStream, ...]
    down_i_axis: int
    tc: int
    vmem_limit_bytes: int


def _stored_i_axis(shape, logical_i_axis):
    swapped = ragged_dot_tuning.stored_minor_to_major_swapped(shape[1], shape[2])
    return (3 - logical_i_axis if swapped else logical_i_axis), swapped


def _legal(tc: int, i_axis: int, dim: int, sublanes: int) -> bool:
    if tc == dim:
        return True
    return tc % (LANES if i_axis == 2 else sublanes) == 0


def small_batch_unsupported(*, num_experts: int, gate_layout) -> str | None:
    """Why the small-batch kernel cannot serve these inputs at any batch, or None."""
    if num_experts > SMALL_BATCH_MAX_EXPERTS:
        return (
            f"{num_experts} experts: its touched-expert list builds [E, E] matrices in VMEM, which compiles on every "
            f"generation up to {SMALL_BATCH_MAX_EXPERTS} experts"
        )
    return None


def small_batch_chunks(
    intermediate: int,
    *,
    gate_up_shape,
    down_shape,
    weights_transposed: bool,
    gate_layout,
    has_gate_up_bias: bool,
    weight_dtype,
    down_dtype=None,
) -> list[int]:
    """The chunks the small-batch kernel can take, largest first: divisors of I that are whole layout tiles of
    every block they cut (gate/up and down weights in their stored orientation, the gate/up bias on lanes)."""
    n_up = 2 * intermediate if gate_layout else intermediate
    width = 2 if gate_layout == "interleaved" else 1  # an interleaved chunk's gate/up block: 2 * tc rows / lanes
    if mxfp4.is_mxfp4(weight_dtype):
        # Read as mxfp4.prepare lays them out: gate/up [E, H / 2, N] (a chunk's columns on lanes, with their scales
        # [E, S(H), N]) and down [E, I / 2, H] (a chunk's tc / 2 packed rows whole uint8 sublane tiles, its tc / 32
        # scale rows whole 32-element blocks).
        def legal_mxfp4(tc):
            rows_ok = tc % (2 * mxfp4.SCALE_ROW_TILE) == 0 or tc == intermediate
            return tc % mxfp4.BLOCK == 0 and rows_ok and _legal(width * tc, 2, n_up, 0)

        return [tc for tc in range(intermediate, 0, -1) if intermediate % tc == 0 and legal_mxfp4(tc)]
    up_axis, _ = _stored_i_axis(gate_up_shape, 2 if weights_transposed else 1)
    down_axis, _ = _stored_i_axis(down_shape, 1 if weights_transposed else 2)
    down_dtype = weight_dtype if down_dtype is None else down_dtype
    sub = max(sublane_multiple(weight_dtype), sublane_multiple(down_dtype))

    def legal(tc):
        ok = _legal(width * tc, up_axis, n_up, sub) and _legal(tc, down_axis, intermediate, sub)
        if has_gate_up_bias:
            ok = ok and _legal(width * tc, 2, n_up, sub)  # bias blocks (1, tc): lanes
        return ok

    return [tc for tc in range(intermediate, 0, -1) if intermediate % tc == 0 and legal(tc)]


def _step_bytes(tc: int, hidden: int, intermediate: int, streams: int, weight_dtype, down_dtype) -> int:
    """The weight bytes a small-batch step reads: the chunk's gate, up and down blocks (MXFP4: packed, with the
    gate/up columns' e8m0 scales)."""
    if mxfp4.is_mxfp4(weight_dtype):
        return (streams + 1) * tc * hidden // 2 + streams * tc * mxfp4.scale_rows(hidden)
    wb = max(jnp.dtype(weight_dtype).itemsize, jnp.dtype(down_dtype or weight_dtype).itemsize)
    return (streams + 1) * tc * hidden * wb


def plan_small_batch(
    tokens: int,
    hidden: int,
    intermediate: int,
    *,
    gate_up_shape,
    down_shape,
    weights_transposed: bool,
    gate_layout,
    has_gate_up_bias: bool,
    hidden_dtype,
    weight_dtype,
    down_dtype=None,
    info: pltpu.TpuInfo | None = None,
    blocks: ExpertsBlocks | None = None,
) -> SmallBatchPlan | None:
    """The small-batch kernel's plan, or None for the grouped path.

    With `blocks.path` None this is the table (the token threshold, the STEP_BYTES chunk, the VMEM_SHARE budget);
    with "small_batch" the kernel is planned at any batch, with `blocks.chunk` if given, and inputs it cannot serve
    or blocks that do not fit VMEM raise ValueError naming the field (api.py has checked the fields' types).
    """
    info = info or chip.current_tpu_info()
    gen = chip.generation_name(info)
    blocks = blocks or ExpertsBlocks()
    forced = blocks.path == "small_batch"
    if blocks.path == "grouped" or tokens == 0:
        return None
    unsupported = small_batch_unsupported(num_experts=gate_up_shape[0], gate_layout=gate_layout)
    if not forced and (tokens > SMALL_BATCH_MAX_TOKENS.get(gen, 8) or unsupported):
        return None
    down_dtype = weight_dtype if down_dtype is None else down_dtype
    is_mx = mxfp4.is_mxfp4(weight_dtype)
    if is_mx != mxfp4.is_mxfp4(down_dtype):
        unsupported = "MXFP4 weights in one projection only: it takes them in both or neither"
        if not forced:
            return None
    if unsupported:
        raise ValueError(f"blocks.path: 'small_batch' cannot serve these inputs: {unsupported}; use 'grouped' or None")
    if is_mx:  # read as mxfp4.prepare lays them out (api.py prepares the checkpoint's layout first)
        up_axis, swap_up, down_axis, swap_down = 2, False, 1, False
    else:
        up_axis, swap_up = _stored_i_axis(gate_up_shape, 2 if weights_transposed else 1)
        down_axis, swap_down = _stored_i_axis(down_shape, 1 if weights_transposed else 2)
    options = small_batch_chunks(
        intermediate,
        gate_up_shape=gate_up_shape,
        down_shape=down_shape,
        weights_transposed=weights_transposed,
        gate_layout=gate_layout,
        has_gate_up_bias=has_gate_up_bias,
        weight_dtype=weight_dtype,
        down_dtype=down_dtype,
    )
    if not options:
        if not forced:
            return None
        raise ValueError(
            f"blocks.path: 'small_batch' cannot serve these inputs: no divisor of I = {intermediate} is whole layout "
            "tiles of the weight and bias blocks it cuts; use 'grouped' or None"
        )
    streams = 2 if gate_layout else 1
    hb = jnp.dtype(hidden_dtype).itemsize
    # Quantized (1-byte) weight blocks are also held cast to the activations' dtype in the kernel body, and their
    # f32 scales sit whole in VMEM (double-buffered).
    # Per quantized operand: (blocks a step, scale columns).
    quantized = [
        (blocks, columns)
        for dtype, blocks, columns in ((weight_dtype, streams, streams * intermediate), (down_dtype, 1, hidden))
        if is_quantized(dtype)
    ]
    cast_bytes = sum(hb * blocks for blocks, _ in quantized)
    scale_bytes = sum(2 * 4 * gate_up_shape[0] * columns for _, columns in quantized)
    if is_mx:
        # The widened planes of a step's blocks, a byte a value of word temporaries; the expert's down scales
        # (double-buffered) and their int32 copy.
        cast_bytes = (hb + 1) * (streams + 1)
        scale_bytes = 6 * mxfp4.scale_rows(intermediate) * hidden

    def step_bytes(tc):
        return _step_bytes(tc, hidden, intermediate, streams, weight_dtype, down_dtype)

    if blocks.chunk is not None:
        tc = check_tile("blocks", "chunk", blocks.chunk)
        if tc not in options:
            tiles = f"128 lanes or {sublane_multiple(weight_dtype)} sublanes, by the weights' stored orientation"
            if is_mx:
                tiles = "MXFP4: 32-row tiles of down_proj's packed rows (a multiple of 64), gate/up's 128 lanes"
            raise ValueError(
                f"blocks.chunk: expected a divisor of I = {intermediate} that is whole layout tiles of the blocks it "
                f"cuts ({tiles}): one of {options}, got {tc}"
            )

    def working_set_bytes(tc):
        return (
            2 * step_bytes(tc)
            + tc * hidden * cast_bytes
            + scale_bytes
            + 4 * tokens * hidden * hb
            + tokens * hidden * 4
            + F32_TEMPORARIES * tokens * (tc * streams + hidden) * 4
            + (2 * tc * tc * hb if is_mx else 0)  # MXFP4: the planes' one-hot selection (double-buffered)
        )

    if blocks.chunk is None:
        budget = MXFP4_STEP_BYTES if is_mx else STEP_BYTES
        fitting = [tc for tc in options if step_bytes(tc) <= budget]
        tc = fitting[0] if fitting else options[-1]
    working_set = working_set_bytes(tc)
    if forced:
        limit = blocks.vmem_limit_bytes
        if limit is None:
            limit = chip.scoped_vmem_limit(info, working_set, ragged_dot_tuning.VMEM_SLACK_BYTES)
        check_vmem_fit("blocks", working_set, limit, info)
    else:
        if working_set > int(info.vmem_capacity_bytes * VMEM_SHARE):
            return None
        limit = chip.scoped_vmem_limit(info, working_set, ragged_dot_tuning.VMEM_SLACK_BYTES)
    if gate_layout == "concatenated":
        up_streams = (WeightStream(up_axis, 0), WeightStream(up_axis, intermediate // tc))
    else:
        up_streams = (WeightStream(up_axis, 0, interleaved=gate_layout == "interleaved"),)
    return SmallBatchPlan(
        swap_gate_up=swap_up,
        swap_down=swap_down,
        up_streams=up_streams,
        down_i_axis=down_axis,
        tc=tc,
        vmem_limit_bytes=limit,
    )


def choose_blocks(
    tokens: int,
    hidden: int,
    intermediate: int,
    *,
    gate_up_shape,
    down_shape,
    weights_transposed: bool,
    gate_layout,
    has_gate_up_bias: bool,
    hidden_dtype,
    weight_dtype,
    down_dtype=None,
    info: pltpu.TpuInfo | None = None,
) -> ExpertsBlocks:
    """The table's choice as a `blocks=` value: the path, and the chunk when it is the small-batch kernel (the
    grouped matmuls' tiles stay the ragged-dot table's)."""
    plan = plan_small_batch(
        tokens,
        hidden,
        intermediate,
        gate_up_shape=gate_up_shape,
        down_shape=down_shape,
        weights_transposed=weights_transposed,
        gate_layout=gate_layout,
        has_gate_up_bias=has_gate_up_bias,
        hidden_dtype=hidden_dtype,
        weight_dtype=weight_dtype,
        down_dtype=down_dtype,
        info=info,
    )
    return ExpertsBlocks(path="grouped") if plan is None else ExpertsBlocks(path="small_batch", chunk=plan.tc)


def candidate_blocks(
    tokens: int,
    hidden: int,
    intermediate: int,
    *,
    gate_up_shape,
    down_shape,
    weights_transposed: bool,
    gate_layout,
    has_gate_up_bias: bool,
    hidden_dtype,
    weight_dtype,
    down_dtype=None,
    info: pltpu.TpuInfo | None = None,
) -> list[ExpertsBlocks]:
    """Paths and chunks worth modeling at this shape (choose_blocks' arguments), the table's choice first: the other
    path, and the small-batch kernel at the legal chunks next to the table's (or to STEP_BYTES' when the table
    takes the grouped path), each where the kernel serves the inputs and fits VMEM. The grouped matmuls' own tilings
    are the ragged-dot table's (their candidates: ragged_dot.tuning.candidate_blocks)."""
    info = info or chip.current_tpu_info()
    kwargs = dict(
        gate_up_shape=gate_up_shape,
        down_shape=down_shape,
        weights_transposed=weights_transposed,
        gate_layout=gate_layout,
        has_gate_up_bias=has_gate_up_bias,
        hidden_dtype=hidden_dtype,
        weight_dtype=weight_dtype,
        down_dtype=down_dtype,
        info=info,
    )
    table = choose_blocks(tokens, hidden, intermediate, **kwargs)
    candidates = [table]
    if table.path == "small_batch":
        candidates.append(ExpertsBlocks(path="grouped"))
    if mxfp4.is_mxfp4(weight_dtype):
        # MXFP4 weights on the grouped path: its blocks widened whole along K; what tiles is the output width a
        # step (the ragged dot's MXFP4_TN unless given): narrower ones for both matmuls.
        for tn in ragged_dot_tuning.MXFP4_TN_OTHERS:
            forward = ragged_dot_tuning.RaggedDotBlocks(forward=ragged_dot_tuning.MatmulBlocks(tn=tn))
            candidates.append(ExpertsBlocks(path="grouped", gate_up=forward, down=forward))
    if tokens == 0 or small_batch_unsupported(num_experts=gate_up_shape[0], gate_layout=gate_layout):
        return candidates
    options = small_batch_chunks(
        intermediate,
        **{k: v for k, v in kwargs.items() if k not in ("hidden_dtype", "info")},
    )
    if not options:
        return candidates
    if table.path == "small_batch":
        at = options.index(table.chunk)
        chunks = [options[i] for i in (at - 1, at + 1) if 0 <= i < len(options)]
    else:
        streams = 2 if gate_layout else 1
        fitting = [
            i
            for i, tc in enumerate(options)
            if _step_bytes(tc, hidden, intermediate, streams, weight_dtype, down_dtype) <= STEP_BYTES
        ]
        at = fitting[0] if fitting else len(options) - 1
        chunks = [options[i] for i in (at - 1, at, at + 1) if 0 <= i < len(options)]
    for tc in chunks:
        candidate = ExpertsBlocks(path="small_batch", chunk=tc)
        try:
            plan_small_batch(tokens, hidden, intermediate, blocks=candidate, **kwargs)
        except ValueError:  # too large for VMEM at this batch
            continue
        candidates.append(candidate)
    return candidates
