"""The process environment of every test process and subprocess: deviceless TPU compiles on a CPU host.

libtpu reads these when it loads, so they must be in place before the first `import jax` / `import torch` (torch
auto-loads torch_tpu, which loads libtpu). Rung 3 of the verification ladder (README.md) rests on them.
"""

import os

DEVICELESS_ENV = {
    "JAX_PLATFORMS": "cpu",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # a second process loading libtpu would otherwise fail on its lockfile
    "TPU_ACCELERATOR_TYPE": "v6e-1",  # quiets libtpu's host probing; compile targets come from the topologies
    "PYTHONWARNINGS": "ignore::UserWarning:torch_tpu",
    "HF_HUB_OFFLINE": "1",  # tests never touch the network
}


def apply():
    for name, value in DEVICELESS_ENV.items():
        os.environ.setdefault(name, value)


def subprocess_env(**extra) -> dict:
    """os.environ plus the deviceless settings (forced) plus `extra`, for a child Python process."""
    return {**os.environ, **DEVICELESS_ENV, **extra}
