"""Chip parameters for the static performance model: the ONE place they live.

Everything except the clock and the launch overhead comes from jax's own table,
`jax.experimental.pallas.tpu.get_tpu_info_for_chip(ChipVersion..., 1)`, i.e. per
TensorCore (a v7x device as seen by `tpu7x:2x2x1` is one TensorCore, half a chip).

The clock is not in that table. It is derived, per generation, as

    clock = bf16_ops_per_second / (num_mxus * mxu_column_size**2 * 2 * MXU_ROWS_PER_CYCLE)

where MXU_ROWS_PER_CYCLE is the compiler's own machine model of the MXU: in the
`*-hlo-static-bundle-profile.txt` dump the capacity of `matmul_packed` (one packed
bf16 `vmatmul` = 16 LHS rows against a full mxu_column_size x mxu_column_size
weight tile) is one per 16 cycles on v5e (1 row/cycle) and one per 8 cycles on
v6e and v7x (2 rows/cycle); the pre-delay schedule spaces `vmatmul`s on one MXU
exactly that far apart. Results: v5e 1.503 GHz, v6e 1.755 GHz, v7x 2.203 GHz.

Cross-check (XLA's own figures for jnp.dot bf16 8192^3, libtpu 0.0.50.1):
`optimal_seconds` = flops / (MXU flops per cycle * clock) gives 1.503 GHz (v5e),
1.751 GHz (v6e), 1.900 GHz (v7x). v5e and v6e agree within 0.3 %; on v7x XLA
assumes a 14 % lower peak than jax's table (996 vs 1155 TFLOP/s per core); we follow
jax's table. Second cross-check: XLA's `estimated_cycles` for a 256 MiB f32
elementwise op divided by our clock gives 81 % of the table's HBM bandwidth on
both v5e and v6e, i.e. the same efficiency, as it should if the clocks are right.
"""

from __future__ import annotations

import dataclasses
import functools

# Per generation: (ChipVersion member name, deviceless topology name,
# MXU rows per cycle from the compiler's bundle profile, see module docstring).
_GENERATIONS = {
    "v5e": ("TPU_V5E", "v5e:2x2", 1),
    "v6e": ("TPU_V6E", "v6e:1x1", 2),
    "v7x": ("TPU_7X", "tpu7x:2x2x1", 2),
}

ALIASES = {
    "v5litepod": "v5e",
    "v6": "v6e",
    "trillium": "v6e",
    "tpu7x": "v7x",
    "7x": "v7x",
    "ironwood": "v7x",
    "v5lite": "v5e",
}

# Fixed cost charged once per Pallas kernel launch. ASSUMED (no public source found):
# the model's only free constant; small against every benchmark shape we care about.
LAUNCH_OVERHEAD_S = 1.0e-6


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-TensorCore parameters of one TPU generation (all figures per core)."""

    gen: str  # "v5e" | "v6e" | "v7x"
    topology: str  # name for jax.experimental.topologies.get_topology_desc
    clock_hz: float  # derived, see module docstring
    hbm_bytes_per_s: float  # tpu_info.mem_bw_bytes_per_second
    bf16_flops_per_s: float  # tpu_info.bf16_ops_per_second
    vmem_bytes: int  # tpu_info.vmem_capacity_bytes
    hbm_bytes: int  # tpu_info.hbm_capacity_bytes
    num_mxus: int  # tpu_info.num_mxus
    mxu_size: int  # tpu_info.mxu_column_size (MXU is mxu_size x mxu_size)
    mxu_rows_per_cycle: int  # compiler machine model (bundle profile)
    launch_overhead_s: float = LAUNCH_OVERHEAD_S

    @property
    def mxu_flops_per_cycle(self) -> int:
        return self.num_mxus * self.mxu_size * self.mxu_size * 2 * self.mxu_rows_per_cycle

    def cycles_to_s(self, cycles: float) -> float:
        return cycles / self.clock_hz

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["mxu_flops_per_cycle"] = self.mxu_flops_per_cycle
        return d


def canonical_gen(gen: str) -> str:
    g = gen.lower().strip()
    g = ALIASES.get(g, g)
    if g not in _GENERATIONS:
        raise ValueError(f"gen must be one of {sorted(_GENERATIONS)}, got {gen!r}")
    return g


@functools.cache
def get_chip(gen: str) -> Chip:
    """Chip parameters for `gen` ("v5e", "v6e" or "v7x")."""
    gen = canonical_gen(gen)
    from jax.experimental.pallas import tpu as pltpu  # public API

    version_name, topology, rows = _GENERATIONS[gen]
    info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, version_name), 1)
    flops_per_cycle = info.num_mxus * info.mxu_column_size**2 * 2 * rows
    return Chip(
        gen=gen,
        topology=topology,
        clock_hz=float(info.bf16_ops_per_second) / flops_per_cycle,
        hbm_bytes_per_s=float(info.mem_bw_bytes_per_second),
        bf16_flops_per_s=float(info.bf16_ops_per_second),
        vmem_bytes=int(info.vmem_capacity_bytes),
        hbm_bytes=int(info.hbm_capacity_bytes),
        num_mxus=int(info.num_mxus),
        mxu_size=int(info.mxu_column_size),
        mxu_rows_per_cycle=rows,
    )


GENERATIONS = tuple(_GENERATIONS)
