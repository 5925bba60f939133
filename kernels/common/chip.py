"""Which TPU generation a kernel is being traced for, as jax's own `TpuInfo`.

Tuning tables are keyed by generation. The chip comes, in order, from: an abstract mesh's device (how TorchTPU
exports without a device), the default device when it is a TPU (a TPU host, or a deviceless-compile topology device
under `jax.default_device`), else the generation named by $TPU_KERNELS_TARGET (v5e, v6e, v7x), else v6e, the
generation the project's benchmarks target.
"""

import os

from jax.experimental.pallas import tpu as pltpu

_GENERATIONS = {
    "v5e": pltpu.ChipVersion.TPU_V5E,
    "v6e": pltpu.ChipVersion.TPU_V6E,
    "v7x": pltpu.ChipVersion.TPU_7X,
}
DEFAULT_GENERATION = "v6e"


def generation_name(info: pltpu.TpuInfo) -> str:
    """Short generation name ("v5e", "v6e", "v7x") used as the key of tuning tables."""
    for name, version in _GENERATIONS.items():
        if info.chip_version == version:
            return name
    return f"v{info.generation}"


def tpu_info_for(generation: str) -> pltpu.TpuInfo:
    if generation not in _GENERATIONS:
        raise ValueError(f"TPU generation: expected one of {sorted(_GENERATIONS)}, got {generation!r}")
    return pltpu.get_tpu_info_for_chip(_GENERATIONS[generation], 1)


def scoped_vmem_ceiling(info: pltpu.TpuInfo) -> int:
    """The most scoped VMEM a kernel asks for: 3/4 of the core's VMEM."""
    return int(info.vmem_capacity_bytes * 0.75)


def scoped_vmem_limit(info: pltpu.TpuInfo, working_set: int, slack_bytes: int = 0) -> int:
    """The `vmem_limit_bytes` a kernel asks for: its working set with 50 % headroom (+ `slack_bytes`), at least the
    16 MiB default scoped limit, at most scoped_vmem_ceiling."""
    return min(scoped_vmem_ceiling(info), max(working_set * 3 // 2 + slack_bytes, 16 << 20))


def current_tpu_info() -> pltpu.TpuInfo:
    """TpuInfo of the chip being traced for (see module docstring for the order of sources)."""
    try:
        return pltpu.get_tpu_info()
    except (ValueError, RuntimeError):
        return tpu_info_for(os.environ.get("TPU_KERNELS_TARGET", DEFAULT_GENERATION))
