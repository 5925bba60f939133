"""Which device the benchmarks measure on, and how its figures are labeled.

On a TPU host the measured rows are labeled "measured <device_kind>" (e.g. "measured TPU v6 lite"). Anywhere else
the kernel runs in Pallas' TPU interpret mode on the CPU and its rows are labeled "cpu interpret" (and the default
implementation's "cpu XLA"): CPU timings say the kernel runs, never how fast a TPU runs it. On a CPU only small shapes
are timed (interpret mode simulates every DMA); the others show "—".

`prepare_environment()` must run before jax (or torch) is imported: without a TPU it applies the project's
deviceless settings (`benchmarks.deviceless`), with one it leaves jax free to find the TPU.
"""

from __future__ import annotations

import dataclasses
import glob
import os

from . import deviceless

CPU_INTERPRET = "cpu interpret"
CPU_XLA = "cpu XLA"
# On a CPU, time only cases that move at most this many HBM bytes (the quick default) / with --full.
CPU_TIMED_MAX_BYTES = 4 << 20
CPU_TIMED_MAX_BYTES_FULL = 160 << 20


def tpu_visible() -> bool:
    """A TPU is attached (checked without importing jax). TPU_KERNELS_BENCH_DEVICE=cpu|tpu overrides."""
    forced = os.environ.get("TPU_KERNELS_BENCH_DEVICE", "").lower()
    if forced in ("cpu", "tpu"):
        return forced == "tpu"
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def prepare_environment() -> None:
    if tpu_visible():
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # the model's compile subprocesses load libtpu too
    else:
        deviceless.apply()


@dataclasses.dataclass(frozen=True)
class Device:
    platform: str  # "tpu" or "cpu" (jax's platform of the default device)
    kind: str  # jax's device_kind
    kernel_label: str  # label of measured kernel rows: "measured <device_kind>" or "cpu interpret"
    default_label: str  # label of measured default-implementation rows
    generation: str | None = None  # the TPU's generation ("v5e", "v6e", "v7x"; from pltpu.get_tpu_info), for the
    # roofline of measured figures; None on a CPU

    @property
    def is_tpu(self) -> bool:
        return self.platform == "tpu"

    def times(self, hbm_bytes: int, full: bool) -> bool:
        """Whether a case moving `hbm_bytes` is timed on this device."""
        if self.is_tpu:
            return True
        return hbm_bytes <= (CPU_TIMED_MAX_BYTES_FULL if full else CPU_TIMED_MAX_BYTES)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def detect() -> Device:
    """The device measured rows run on, from jax itself (so a label can never claim a TPU that is not there)."""
    import jax

    dev = jax.devices()[0]
    if dev.platform == "tpu":
        label = f"measured {dev.device_kind}"
        return Device("tpu", dev.device_kind, label, label, _generation())
    return Device(dev.platform, dev.device_kind, CPU_INTERPRET, CPU_XLA)


def _generation() -> str | None:
    """The attached TPU's generation name, from jax's own chip facts (None where jax does not know the chip)."""
    from jax.experimental.pallas import tpu as pltpu

    from tpu_kernels_jax.common.chip import generation_name

    try:
        return generation_name(pltpu.get_tpu_info())
    except (ValueError, RuntimeError):
        return None


def provenance() -> dict:
    """What a measured figure was taken with: jax and jaxlib versions, the backend's platform version (libtpu's
    build on a TPU) and the UTC date."""
    import datetime

    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform_version": " ".join(str(getattr(dev.client, "platform_version", "")).split()),  # one line
        "device_kind": dev.device_kind,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
    }
