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

# Bytes of one input slab per grid step. v5e has half v6e's HBM bandwidth, so a smaller slab takes as long.
TARGET_SLAB_BYTES = {"v5e": 2 << 20, "v6e": 4 << 20, "v7x": 4 << 20}
# Live f32 copies of a slab inside the kernel body (upcast x, its square / normalised value, the scaled result).
F32_TEMPORARIES = 3
# Never ask for more than this share of the core's VMEM.
VMEM_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class RmsNormBlocks:
    block_rows: int
    vmem_limit_bytes: int


def sublane_multiple(dtype) -> int:
    """Row granularity of a block: 8 sublanes of 32-bit, 16 rows for 16-bit dtypes (two rows packed per sublane)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def choose_blocks(rows: int, hidden: int, dtype, *, streams: int, info: pltpu.TpuInfo | None = None) -> RmsNormBlocks:
    """Block sizes for a kernel that moves `streams` (rows, hidden) arrays of `dtype` between HBM and VMEM."""
    info = info or chip.current_tpu_info()
    generation = chip.generation_name(info)
    itemsize = jnp.dtype(dtype).itemsize
    multiple = sublane_multiple(dtype)
    # Per row: every stream double-buffered by the pipeline, plus the kernel body's f32 temporaries.
    bytes_per_row = hidden * (streams * 2 * itemsize + F32_TEMPORARIES * 4)
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
    working_set = block_rows * bytes_per_row + 2 * 2 * hidden * 4  # + the (1, hidden) weight, double-buffered
    vmem_limit = chip.scoped_vmem_limit(info, working_set)
    return RmsNormBlocks(block_rows=block_rows, vmem_limit_bytes=vmem_limit)
