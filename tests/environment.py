"""The process environment of every test process and subprocess: the deviceless-compile settings of
`benchmarks.deviceless` (one definition for tests, benchmarks and the performance model), and which tier runs.

ON_CHIP (TPU_KERNELS_ON_CHIP=1, `make tpu-check`): the on-chip tier, on a machine with a TPU. The kernels compile
with Mosaic and run on the chip against the same references, and none of the deviceless settings apply (jax must
find the TPU). Otherwise the whole ladder runs on the CPU host (`make test`)."""

import os

from benchmarks.deviceless import DEVICELESS_ENV, apply, subprocess_env

ON_CHIP = os.environ.get("TPU_KERNELS_ON_CHIP") == "1"

__all__ = ["DEVICELESS_ENV", "ON_CHIP", "apply", "subprocess_env"]
