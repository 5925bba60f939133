"""Checks shared by the kernels' `blocks=` parameters (one frozen dataclass of tile sizes per kernel).

A caller's tiling is checked before anything is traced, with an error that names the field, what the layout needs and
what was given: Mosaic would otherwise fail deep in lowering, or a block that overflows VMEM would fail to compile.
"""

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from . import chip

LANES = 128  # the minor dimension of a vreg and of every VMEM tile


def pow2_floor(x: int) -> int:
    """The largest power of two <= x (1 for x < 2)."""
    return 1 << (max(1, int(x)).bit_length() - 1)


def sublane_multiple(dtype) -> int:
    """Second-minor granularity of a block: 8 rows of 32-bit, 16 of 16-bit (two rows a sublane), 32 of 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def check_tile(owner: str, field: str, value, *, multiple: int = 1, at_most: int | None = None, why: str = "") -> int:
    """A tile size: a positive int, a multiple of `multiple` (the layout tile), at most `at_most` (the array)."""
    name = f"{owner}.{field}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    if value % multiple:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{name}: expected a multiple of {multiple}{reason}, got {value}")
    if at_most is not None and value > at_most:
        raise ValueError(f"{name}: expected at most {at_most}, got {value}")
    return value


def check_block_dim(owner: str, field: str, value, *, dim: int, multiple: int, why: str, dim_name: str) -> int:
    """A block size along an array dimension of `dim` elements; returns the block to use, at most `dim`.

    A block smaller than the dimension must be a whole number of layout tiles (`multiple`, e.g. sublanes); one at
    least as large covers the dimension with one block, which is legal for any size (a block equal to the full
    dimension), so it is used as exactly `dim`.
    """
    value = check_tile(owner, field, value)
    if value < dim and value % multiple:
        raise ValueError(
            f"{owner}.{field}: expected a multiple of {multiple} ({why}) or at least {dim_name} = {dim}, got {value}"
        )
    return min(value, dim)


def check_vmem_fit(owner: str, working_set_bytes: int, vmem_limit_bytes: int, info: pltpu.TpuInfo | None = None):
    """The blocks' VMEM working set (double-buffered streams and scratch) must fit the generation's VMEM."""
    info = info or chip.current_tpu_info()
    capacity = info.vmem_capacity_bytes
    generation = chip.generation_name(info)
    if vmem_limit_bytes is not None:
        vmem_limit_bytes = check_tile(owner, "vmem_limit_bytes", vmem_limit_bytes)
    if working_set_bytes > capacity:
        raise ValueError(
            f"{owner}: these blocks need {working_set_bytes / 2**20:.1f} MiB of VMEM, more than the "
            f"{capacity / 2**20:.0f} MiB of a {generation} core; use smaller blocks"
        )
    if vmem_limit_bytes is not None and not 0 < vmem_limit_bytes <= capacity:
        raise ValueError(
            f"{owner}.vmem_limit_bytes: expected 1 to {capacity} bytes (the VMEM of a {generation} core), "
            f"got {vmem_limit_bytes}"
        )
    # The scoped limit is what Mosaic lets the kernel use: a working set above it fails to compile (VMEM OOM).
    if vmem_limit_bytes is not None and working_set_bytes > vmem_limit_bytes:
        raise ValueError(
            f"{owner}: these blocks need {working_set_bytes / 2**20:.1f} MiB of VMEM, more than the "
            f"vmem_limit_bytes of {vmem_limit_bytes / 2**20:.1f} MiB on {generation} (given, or derived: at most "
            f"3/4 of the core's {capacity / 2**20:.0f} MiB); use smaller blocks"
        )
