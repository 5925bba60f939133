"""The process environment for deviceless TPU compiles on a CPU host: one definition for the tests, the benchmarks
and the performance model's compile subprocesses.

libtpu reads these when it loads, so they must be in place before the first `import jax` / `import torch` (torch
auto-loads torch_tpu, which loads libtpu). Rung 3 of the verification ladder (README.md) rests on them. This module
imports nothing but `os`, so it can be imported before jax.
"""

import os

DEVICELESS_ENV = {
    "JAX_PLATFORMS": "cpu",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # a second process loading libtpu would otherwise fail on its lockfile
    "TPU_ACCELERATOR_TYPE": "v6e-1",  # quiets libtpu's host probing; compile targets come from the topologies
    "PYTHONWARNINGS": "ignore::UserWarning:torch_tpu",
    "HF_HUB_OFFLINE": "1",  # tests and benchmarks never touch the network
}


def apply():
    """Set the deviceless environment in this process, keeping any value the caller already set."""
    for name, value in DEVICELESS_ENV.items():
        os.environ.setdefault(name, value)


def subprocess_env(**extra) -> dict:
    """os.environ plus the deviceless settings (forced) plus `extra`, for a child Python process."""
    return {**os.environ, **DEVICELESS_ENV, **extra}
