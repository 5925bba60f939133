"""vLLM's TPU kernels (the `tpu-inference` wheel) as benchmark baselines, imported one module at a time.

tpu-inference's package `__init__` imports vllm (and through it torch); its Pallas kernels need neither.
`kernel_module(name)` imports one kernel module from its file: the packages above it are registered as empty
stand-ins whose `__init__` never runs (their `__path__` is the installed directory, so the kernel's own absolute
imports of its sibling modules find the real files), and `tpu_inference.logger`, which wraps vllm's logger, is
replaced by a stand-in over `logging`. Nothing else of the package is imported.

The kernels ask `jax.devices()[0]` which TPU generation they run on; under the performance model's deviceless trace
that is the CPU. `kernel_module` points a module's `get_tpu_version` at the chip being traced for instead
(`tpu_kernels_jax.common.chip.current_tpu_info`: the default device, which the model sets to the TPU it compiles
for), which on a TPU host answers as the original does.

Installed from the wheel with `pip install --no-deps` (scripts/tpu_wheels.sh); without it every vLLM baseline reports
`missing()` as its reason.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import logging
import pathlib
import sys
import types

PACKAGE = "tpu_inference"
DISTRIBUTION = "tpu-inference"
VERSION = "0.32.0"  # the version the wrappers were written against (scripts/tpu_wheels.sh downloads it)


@functools.cache
def _location() -> str | None:
    """The installed package's directory (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return locations[0] if locations else None


def missing() -> str | None:
    """Why vLLM's kernels cannot be imported here ("not installed: tpu-inference"), or None."""
    return None if _location() else f"not installed: {DISTRIBUTION}"


class _OnceLogger(logging.LoggerAdapter):
    """vllm's logger methods the kernels call (warning_once, info_once, debug_once), over a plain logger."""

    def __init__(self, logger):
        super().__init__(logger, {})
        self._seen = set()

    def _once(self, level, msg, *args):
        if (level, msg, args) not in self._seen:
            self._seen.add((level, msg, args))
            self.log(level, msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args)


def _logger_standin() -> types.ModuleType:
    """tpu_inference.logger over `logging`, quiet unless the application sets up the "vllm" logger (the kernels log
    their block sizes, once per shape)."""
    logging.getLogger("vllm").addHandler(logging.NullHandler())
    module = types.ModuleType(f"{PACKAGE}.logger")
    module.init_logger = lambda name: _OnceLogger(logging.getLogger(f"vllm.{name}"))
    return module


def _tpu_version() -> int:
    """The generation (5, 6, 7) of the TPU being traced for: the default device's, else $TPU_KERNELS_TARGET's."""
    from tpu_kernels_jax.common import chip

    return int(chip.current_tpu_info().generation)


def _root() -> pathlib.Path:
    why = missing()
    if why:
        raise ImportError(why)
    return pathlib.Path(_location())


def _register_packages(module_name: str) -> None:
    """Empty stand-ins for PACKAGE and every package above `module_name` not imported yet (their __init__ never
    runs), each with its installed directory as __path__; and the logger stand-in."""
    root = _root()
    parts = module_name.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name in sys.modules:
            continue
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*parts[1:i]))]
        package.__package__ = name
        package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        package.__spec__.submodule_search_locations = list(package.__path__)
        sys.modules[name] = package
    sys.modules.setdefault(f"{PACKAGE}.logger", _logger_standin())


@functools.cache
def kernel_module(name: str) -> types.ModuleType:
    """The module tpu_inference.<name> (e.g. "kernels.ragged_paged_attention.v3.kernel"), imported without the
    package's __init__; ImportError("not installed: tpu-inference") when the wheel is not installed."""
    full = f"{PACKAGE}.{name}"
    _register_packages(full)
    module = importlib.import_module(full)
    if hasattr(module, "get_tpu_version"):
        module.get_tpu_version = _tpu_version
    return module
