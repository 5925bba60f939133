"""Import the JAX side of the kernels (`kernels/<name>/`) without torch.

The api modules use relative imports (`from ..common import chip`), so they need a parent package. In the Hub build
and in `torch-ext/` that parent is `tpu_kernels._pallas`, but importing `tpu_kernels` imports torch (and torch_tpu,
which loads libtpu) — seconds of start-up the benchmarks and the performance model's compile subprocesses do not
need. Here the parent is a synthetic package, `tpu_kernels_jax`, whose path is the repo's `kernels/` directory.

Functions handed to the performance model are pickled by reference, so they must live in a module the compile
subprocess can import by name: the benchmark ops modules (`benchmarks/ops/*.py`) import the kernels through this
module at import time, which registers the synthetic package in that process too.
"""

import importlib
import importlib.machinery
import importlib.util
import pathlib
import sys

PACKAGE = "tpu_kernels_jax"
KERNELS_DIR = pathlib.Path(__file__).resolve().parent.parent / "kernels"


def _package():
    pkg = sys.modules.get(PACKAGE)
    if pkg is None:
        spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        pkg = importlib.util.module_from_spec(spec)
        pkg.__path__ = [str(KERNELS_DIR)]
        sys.modules[PACKAGE] = pkg
    return pkg


def load(module: str):
    """The module `kernels/<module>` (dotted, e.g. "rms_norm.api" or "common.interpret")."""
    _package()
    return importlib.import_module(f"{PACKAGE}.{module}")
