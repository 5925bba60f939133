"""Running the TPU kernels on a host without a TPU: Pallas' TPU interpret mode.

The api functions trace plain (compiled) `pallas_call`s, so exporting or compiling them for a TPU always yields
Mosaic kernels. On a CPU they run through `pltpu.force_tpu_interpret_mode`, which simulates HBM, VMEM, SMEM, DMAs
and semaphores on the CPU: the same kernel code, not a re-implementation.
"""

import contextlib
import functools

import jax
import numpy as np
from jax._src import config as _jax_config
from jax.experimental.pallas import tpu as pltpu

try:  # the module of jax's TPU interpreter (jax 0.10 - 0.12)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _interpreter
except ImportError:  # pragma: no cover - older layout
    from jax._src.pallas.mosaic import interpret as _interpreter

# What the CPU paths (torch CPU ops, eager JAX calls on CPU arrays) use: out-of-bounds reads raise and uninitialized
# VMEM reads as NaN, so a kernel bug shows up as an error or NaN rather than a plausible number.
CPU_INTERPRET_PARAMS = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")

# What the test ladder uses: the above plus the happens-before race detector over DMAs and semaphores.
STRICT_INTERPRET_PARAMS = pltpu.InterpretParams(
    detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan", dma_execution_mode="on_wait"
)


@contextlib.contextmanager
def interpreter_in_shard_map():
    """Within this block jax's TPU interpreter runs without shard_map's varying-axes checks (check_vma).

    The interpreter (jax 0.10 - 0.12) evaluates a kernel's index maps by binding primitives on the scalar-prefetch
    operands as given, which vary over shard_map's manual axes, together with its own grid indices, which do not;
    check_vma refuses that mix ("requires varying manual axes to match"). pallas_call itself traces kernel bodies with
    the check off; the interpreter's lowering lacks the same. Only the interpret mode is affected: the lowering to a
    Mosaic kernel evaluates nothing. The replaced function is jax's own, called unchanged under the setting."""
    original = _interpreter.interpret_pallas_call

    @functools.wraps(original)
    def unchecked(*args, **kwargs):
        with _jax_config._check_vma(False):
            return original(*args, **kwargs)

    _interpreter.interpret_pallas_call = unchecked
    try:
        yield
    finally:
        _interpreter.interpret_pallas_call = original


def interpret_mode_forced() -> bool:
    """True when a caller has already chosen TPU interpret mode (e.g. the tests' strict parameters)."""
    return _jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


@contextlib.contextmanager
def interpret_on_cpu(params: pltpu.InterpretParams = CPU_INTERPRET_PARAMS):
    """Run Pallas TPU kernels traced inside this block in interpret mode, unless a mode was already forced."""
    if interpret_mode_forced():
        yield
        return
    with pltpu.force_tpu_interpret_mode(params), interpreter_in_shard_map():
        yield


def _on_cpu(x) -> bool:
    """A concrete array the call will compute on a CPU: a jax.Array on CPU devices, or a host (numpy) array, which
    jax puts on the default device, when that is a CPU."""
    if isinstance(x, np.ndarray):
        default = jax.config.jax_default_device  # a Device, a platform name, or None (the default backend's)
        platform = getattr(default, "platform", default) or jax.default_backend()
        return platform == "cpu"
    return (
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and all(d.platform == "cpu" for d in x.devices())
    )


def interpret_eager_cpu_calls(fn):
    """Decorator for the public JAX API: an eager call on concrete CPU arrays runs in interpret mode.

    Under `jax.jit`/`jax.export` the arguments are tracers and nothing changes, so tracing for a TPU still produces
    Mosaic kernels; jitting for the CPU needs an explicit `interpret_on_cpu()` block around the call.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if any(_on_cpu(leaf) for leaf in leaves):
            with interpret_on_cpu():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper
