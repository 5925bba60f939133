"""What a kernel's benchmark is made of, and the registry of kernels that have one.

A kernel's benchmark lives in `benchmarks/ops/<kernel>.py` and defines `SUITE = Suite(...)`: its operations (each a
Pallas kernel path and the default implementation of the same operation, the plain JAX/XLA path), the shapes from
`benchmarks/shapes.py`, the HBM bytes and MXU flops one call must move/do at least (for the roofline), and the
performance targets it is held to. `benchmarks/test_<kernel>.py` is its pytest-benchmark suite (a few lines: the shared
`measure` fixture does the timing). Adding both files is all a new kernel needs; `python -m benchmarks` finds it.

An op whose kernel takes `blocks=` also lists its candidate tilings (`Op.candidates`, from the kernel's
`tuning.candidate_blocks`): `python -m benchmarks --kernel K --sweep` (benchmarks/sweep.py) models each one at the
suite's `sweep_shapes` and reports the best beside the table's choice.

Every function handed to the performance model is compiled in a subprocess and pickled by reference: `kernel` and
`default` must be module-level functions of the ops module (or functools.partials of them).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable

from . import ops as _ops_package
from .shapes import Shape

# Every case is timed and modeled at least twice: the Pallas kernel, and the default implementation of the same
# operation. An op may add further baselines (modeled only), each impl "baseline:<name>".
IMPLS = ("kernel", "default")
BASELINE_PREFIX = "baseline:"


@dataclasses.dataclass(frozen=True)
class Baseline:
    """Another implementation of the op to compare against (modeled, compiled in the same run)."""

    name: str  # column label, e.g. "tokamax"
    fn: Callable  # module-level function, same arguments as the kernel
    unsupported: Callable[[Shape], str | None] = lambda shape: None  # why it does not apply to a shape, or None


@dataclasses.dataclass(frozen=True)
class InPlace:
    """How a TPU measures an op that updates state in place (the KV cache write), as a server runs it: each
    implementation's function takes `n_state` state arrays first, then the op's arguments, and returns the new state
    first; the state is donated, and each call's returned state is the next call's (benchmarks/device_timing.py).
    The performance model compiles the same functions with the state donated (benchmarks/modeled.py); the op's own
    `kernel` / `default` / baselines allocate the state in the program instead (a CPU run, and any implementation
    without an in-place function here)."""

    functions: dict[str, Callable]  # impl ("kernel", "default", "baseline:<name>") -> module-level function
    state: Callable[[Shape, int], tuple]  # (shape, seed) -> the initial state arrays, made on the device
    n_state: int


@dataclasses.dataclass(frozen=True)
class PartialInputs:
    """What an op's `arrays` returns when some implementations' inputs could not be built (a backward whose residuals
    come from a baseline's forward that does not compile at the shape): the arguments, with placeholders of the
    right shapes for those implementations' parts, and {impl: why} for each of them, which then show the reason
    instead of a timing."""

    args: tuple
    failed: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Op:
    name: str  # e.g. "rms_norm", "fused_add_rms_norm"
    kernel: Callable  # the Pallas path (module-level function)
    default: Callable | None  # the default implementation: plain JAX, compiled by XLA (None: not timed, in a
    # measured sweep's tiling variants)
    specs: Callable[[Shape], tuple]  # shape -> argument ShapeDtypeStructs
    hbm_bytes: Callable[[Shape], int]  # bytes one call must move between HBM and the core, at least
    mxu_flops: Callable[[Shape], int] = lambda shape: 0  # matmul flops (0 for memory-bound kernels)
    arrays: Callable | None = None  # (shape, seed) -> concrete arguments; default: random normal specs
    model_args: Callable | None = None  # shape -> arguments for the model when specs are not enough
    # (e.g. concrete group sizes for ragged dot)
    default_name: str = "XLA default"
    baselines: tuple[Baseline, ...] = ()
    static: Callable[[Shape], dict] | None = None  # shape -> static keyword arguments bound (functools.partial)
    # to kernel, default and baselines (e.g. the activation)
    candidates: Callable[[Shape, str], list] | None = None  # (shape, generation) -> the tilings `--sweep` models:
    # the kernel's `blocks=` values from its tuning module's candidate_blocks, the table's choice first
    in_place: InPlace | None = None  # measured on a TPU with donated state (see InPlace)
    # Whether the op's inputs follow the kernel's tiling: its specs, arrays and model_args then take `blocks=` (the
    # kernel's tiling) and `impls=` (the implementations whose inputs to build). A backward whose residuals come from
    # the forward: flash attention's output and lse are laid out by the forward's kv heads a step.
    tiling_inputs: bool = False

    def impls(self, shape: Shape) -> dict[str, str | None]:
        """{impl: None if it applies to `shape`, else the reason it does not}: kernel, default, then baselines."""
        out = {impl: None for impl in IMPLS if impl != "default" or self.default is not None}
        for b in self.baselines:
            out[BASELINE_PREFIX + b.name] = b.unsupported(shape)
        return out

    def in_place_function(self, impl: str, shape: Shape) -> Callable:
        """The in-place function of `impl` for `shape` (see InPlace), its static arguments bound."""
        fn = self.in_place.functions[impl]
        return functools.partial(fn, **self.static(shape)) if self.static else fn

    def function(self, impl: str, shape: Shape, blocks=None) -> Callable:
        """The function of `impl` for `shape` (picklable by reference, for the model's subprocess); `blocks`: the
        kernel's tiling (its `blocks=`; None: the tuning table's)."""
        if impl == "kernel":
            fn = self.kernel
        elif impl == "default":
            fn = self.default
        else:
            fn = {BASELINE_PREFIX + b.name: b.fn for b in self.baselines}[impl]
        static = self.static(shape) if self.static else {}
        if blocks is not None:
            if impl != "kernel":
                raise ValueError(f"blocks: only the kernel takes a tiling, not {impl!r}")
            static = dict(static, blocks=blocks)
        return functools.partial(fn, **static) if static else fn


@dataclasses.dataclass(frozen=True)
class Targets:
    """Performance targets checked on the modeled figures (None / False: not checked)."""

    goal: str = ""  # the targets in one line, printed above them, e.g. ">= 85 % of the HBM roofline at >= 4096 tokens"
    min_efficiency: float | None = None  # roofline / modeled kernel time, at least ...
    min_efficiency_from_batch: int = 0  # ... for shapes with batch >= this
    beats_default: bool = False  # modeled kernel time < modeled default time at every shape
    custom: Callable[[list], list] | None = None  # rows -> more target dicts (see harness.check_targets)


@dataclasses.dataclass(frozen=True)
class Case:
    op: Op
    shape: Shape

    @property
    def id(self) -> str:
        return f"{self.op.name} {self.shape.id}"


@dataclasses.dataclass(frozen=True)
class Suite:
    kernel: str
    ops: tuple[Op, ...]
    shapes: tuple[Shape, ...]
    targets: Targets = Targets()
    batch_unit: str = "tokens"  # what the throughput counts: tokens/s
    quick_shapes: tuple[Shape, ...] | None = None  # modeled without --full (None: every shape)
    sweep_shapes: tuple[Shape, ...] | None = None  # swept without --full (None: the quick shapes): a sweep models
    # every candidate tiling of every op at each shape, so it gets a few representative ones
    flops_columns: bool = False  # a matmul-bound kernel: the table adds TFLOP/s and % of MXU peak (its mxu_flops over
    # the modeled kernel time) and the chart plots TFLOP/s against the batch unit instead of throughput

    def cases(self, shapes: tuple[Shape, ...] | None = None) -> list[Case]:
        return [Case(op, shape) for op in self.ops for shape in (self.shapes if shapes is None else shapes)]


def select_shapes(shapes, filters) -> tuple[Shape, ...]:
    """The shapes whose id holds every string of `filters` (e.g. ("head_dim=512", "mask=causal")); all of them
    where `filters` is empty."""
    return tuple(s for s in shapes if all(f in s.id for f in filters or ()))


def available() -> list[str]:
    """Kernels with a benchmark suite (a module in benchmarks/ops/ defining SUITE)."""
    return sorted(m.name for m in pkgutil.iter_modules(_ops_package.__path__) if not m.name.startswith("_"))


def get(kernel: str) -> Suite:
    if kernel not in available():
        raise ValueError(f"--kernel: expected one of {available()}, got {kernel!r}")
    return importlib.import_module(f"{_ops_package.__name__}.{kernel}").SUITE
