"""Static TPU performance model (rung 4 of the verification ladder).

    from benchmarks import perf_model
    m = perf_model.model_function(fn, args, gen="v6e")
    m.modeled_s, m.label  # -> seconds, "modeled v6e"
    ms = perf_model.model_functions([(fn1, args1), (fn2, args2)], gen="v6e")  # one compile subprocess

See README.md in this directory for the method, calibration and limitations.
"""

from .chips import GENERATIONS, Chip, get_chip
from .model import (
    KernelModel,
    ProgramModel,
    XlaOpModel,
    compile_deviceless,
    compile_deviceless_many,
    donated,
    model_function,
    model_functions,
    trace_device,
    xla_op_estimates,
)

__all__ = [
    "GENERATIONS",
    "Chip",
    "get_chip",
    "KernelModel",
    "ProgramModel",
    "XlaOpModel",
    "compile_deviceless",
    "compile_deviceless_many",
    "donated",
    "model_function",
    "model_functions",
    "trace_device",
    "xla_op_estimates",
]
