"""XLA:CPU compiles of the test processes at LLVM's lowest optimization level.

Compiling for the host CPU is about two fifths of the suite's time: every interpret-mode kernel (rung 1, and the torch
ops' CPU path) is an XLA:CPU program of a few hundred small fusions, run once or twice, for which LLVM's optimization
passes cost more than they save (an experts_forward gradient: 5.8 -> 4.5 s to compile). jax's own switch,
`jax_disable_most_optimizations`, applies to every backend, and the deviceless TPU compiles (rungs 3 and 4) must
stay the programs a TPU runs, so the debug options are set here on the CPU client's compiles only, in the place
jax hands them to the backend. What is computed does not change: only code generation, within float rounding."""

import functools

from jax._src import compiler


def lowest_optimization_for_cpu_compiles() -> bool:
    """Wrap jax's backend compile (jax 0.10 - 0.12) so that compiles for the CPU platform skip LLVM's optimizations.
    Returns whether jax has the hook (the caller asserts it: a moved hook must not silently slow the suite)."""
    original = getattr(compiler, "backend_compile_and_load", None)
    if original is None or getattr(original, "_cpu_compiles_unoptimized", False):
        return original is not None

    @functools.wraps(original)
    def compile_and_load(backend, module, executable_devices, options, *args, **kwargs):
        if getattr(backend, "platform", None) == "cpu":
            debug = options.executable_build_options.debug_options
            debug.xla_backend_optimization_level = 0
            debug.xla_llvm_disable_expensive_passes = True
        return original(backend, module, executable_devices, options, *args, **kwargs)

    compile_and_load._cpu_compiles_unoptimized = True
    compiler.backend_compile_and_load = compile_and_load
    return True
