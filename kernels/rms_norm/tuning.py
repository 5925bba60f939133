"""Row-block sizes for the RMSNorm kernels, per TPU generation.

RMSNorm is memory-bound: each grid step streams a (block_rows, hidden) slab in and out, so blocks should be large
enough that the ~0.35 us fixed cost of a grid step hides behind the slab's DMA, yet small enough that the
double-buffered streams plus the f32 temporaries fit the VMEM the kernel asks for. Every entry is proven by the
deviceless compile test at the benchmark shapes on v5e, v6e and v7x.
"""

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ..common import chip
from ..common.blocks import check_block_dim, check_vmem_fit, sublane_multiple

# Bytes of one input slab per grid step. v5e has half v6e's HBM bandwidth, so a smaller slab takes as long.
TARGET_SLAB_BYTES = {"v5e": 2 << 20, "v6e": 4 << 20, "v7x": 4 << 20}
# Live f32 copies of a slab inside the kernel body (upcast x, its square / normalised value, the scaled result).
F32_TEMPORARIES = 3
# Never ask for more than this share of the core's VMEM.
VMEM_SHARE = 0.5
# candidate_blocks: the table's row block times these factors (a sweep around the choice, not a search).
CANDIDATE_FACTORS = (1 / 4, 1 / 2, 2, 4)


@dataclasses.dataclass(frozen=True)
class RmsNormBlocks:
    """Tile sizes of the RMSNorm kernels: the `blocks=` of rms_norm, fused_add_rms_norm and rms_norm_backward.

    block_rows: rows of the (rows, hidden) view of x per grid step. Below the row count it must be a multiple of the
        sublane tile (8 rows of 32-bit, 16 of bfloat16; float16 runs through the kernels as float32, so 8); at or
        above it, one block holds every row. None: the tuning table's.
    vmem_limit_bytes: the scoped VMEM the kernels may use; None: derived from the blocks' working set
        (`chip.scoped_vmem_limit`), as the table does.

    One block size serves the forward, the fused forward and the backward of a call (the gradient of rms_norm and
    fused_add_rms_norm runs its kernel with the blocks the forward was given), so the working set is sized for the
    widest of them, 4 row streams.
    """

    block_rows: int | None = None
    vmem_limit_bytes: int | None = None


def _bytes_per_row(hidden: int, itemsize: int, streams: int) -> int:
    """VMEM per row of a block: every stream double-buffered by the pipeline, plus the body's f32 temporaries."""
    return hidden * (streams * 2 * itemsize + F32_TEMPORARIES * 4)


def _working_set(block_rows: int, hidden: int, itemsize: int, streams: int) -> int:
    return block_rows * _bytes_per_row(hidden, itemsize, streams) + 2 * 2 * hidden * 4  # + the (1, hidden) weight


def choose_blocks(rows: int, hidden: int, dtype, *, streams: int, info: pltpu.TpuInfo | None = None) -> RmsNormBlocks:
    """Block sizes for a kernel that moves `streams` (rows, hidden) arrays of `dtype` between HBM and VMEM."""
    info = info or chip.current_tpu_info()
    generation = chip.generation_name(info)
    itemsize = jnp.dtype(dtype).itemsize
    multiple = sublane_multiple(dtype)
    bytes_per_row = _bytes_per_row(hidden, itemsize, streams)
    vmem_budget = int(info.vmem_capacity_bytes * VMEM_SHARE)
    rows_by_vmem = vmem_budget // bytes_per_row
    if rows_by_vmem < min(rows, multiple):
        raise ValueError(
            f"x: hidden size {hidden} is too large for this kernel: {min(rows, multiple)} rows of it need "
            f"{min(rows, multiple) * bytes_per_row} bytes of VMEM, over the {vmem_budget} it may use on {generation}"
        )
    rows_by_target = TARGET_SLAB_BYTES.get(generation, TARGET_SLAB_BYTES["v6e"]) // (hidden * itemsize)
    block_rows = max(multiple, min(rows_by_vmem, rows_by_target) // multiple * multiple)
    if block_rows >= rows:
        block_rows = rows  # one block covering every row: a block equal to the full dimension is always legal
    vmem_limit = chip.scoped_vmem_limit(info, _working_set(block_rows, hidden, itemsize, streams))
    return RmsNormBlocks(block_rows=block_rows, vmem_limit_bytes=vmem_limit)


def check_blocks_type(blocks):
    if blocks is not None and not isinstance(blocks, RmsNormBlocks):
        raise TypeError(f"blocks: expected an RmsNormBlocks or None, got {type(blocks).__name__}")


def resolve_blocks(
    blocks: RmsNormBlocks | None, rows: int, hidden: int, dtype, *, streams: int, info: pltpu.TpuInfo | None = None
) -> RmsNormBlocks:
    """The blocks a kernel runs with: the table's for None (and for fields left None), else the caller's, checked.

    Raises TypeError/ValueError naming the field (`blocks.block_rows`, `blocks.vmem_limit_bytes`) for a block that
    is not a whole number of sublane tiles, or a working set that does not fit this generation's VMEM.
    """
    check_blocks_type(blocks)
    info = info or chip.current_tpu_info()
    if blocks is None or blocks == RmsNormBlocks():
        return choose_blocks(rows, hidden, dtype, streams=streams, info=info)
    if blocks.block_rows is None:
        block_rows = choose_blocks(rows, hidden, dtype, streams=streams, info=info).block_rows
    else:
        block_rows = check_block_dim(
            "blocks",
            "block_rows",
            blocks.block_rows,
            dim=rows,
            multiple=sublane_multiple(dtype),
            why=f"the sublane tile of {jnp.dtype(dtype).name} rows, the dtype the kernels run in",
            dim_name="the rows of x",
        )
    working_set = _working_set(block_rows, hidden, jnp.dtype(dtype).itemsize, streams)
    vmem_limit = blocks.vmem_limit_bytes
    if vmem_limit is None:
        vmem_limit = chip.scoped_vmem_limit(info, working_set)
    check_vmem_fit("blocks", working_set, vmem_limit, info)
    return RmsNormBlocks(block_rows=block_rows, vmem_limit_bytes=int(vmem_limit))


def candidate_blocks(
    rows: int, hidden: int, dtype, *, streams: int, info: pltpu.TpuInfo | None = None
) -> list[RmsNormBlocks]:
    """Legal blocks worth modeling at this shape: the table's choice first, then row blocks a quarter to four times
    its size (whole sublane tiles, at most every row, fitting this generation's scoped VMEM limit)."""
    info = info or chip.current_tpu_info()
    choice = choose_blocks(rows, hidden, dtype, streams=streams, info=info)
    multiple = sublane_multiple(dtype)
    candidates = [choice]
    for factor in CANDIDATE_FACTORS:
        block_rows = max(multiple, int(choice.block_rows * factor) // multiple * multiple)
        try:
            blocks = resolve_blocks(
                RmsNormBlocks(block_rows=block_rows), rows, hidden, dtype, streams=streams, info=info
            )
        except ValueError:  # too large for the scoped VMEM limit
            continue
        if all(blocks.block_rows != c.block_rows for c in candidates):
            candidates.append(blocks)
    return candidates[:1] + sorted(candidates[1:], key=lambda b: b.block_rows)
