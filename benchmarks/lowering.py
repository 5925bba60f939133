"""Tracing and lowering the measured programs in worker processes, beside the process that runs the chip.

On the v5e host a case's programs took 1-50 s of Python to trace and lower (a Pallas kernel's body is traced once
per shape: vLLM's fused MoE ~15 s, JAX's ragged paged attention ~2.7 s, a flash attention backward ~1.4 s), all of
it under the GIL of the one process that may hold the chip: about 60 % of a measured run's host time, at ~9 s a case.
XLA's and Mosaic's compiles already run on threads (they release the GIL); tracing cannot, so it goes to processes.

Each worker is a deviceless process (benchmarks/deviceless.py: JAX on the CPU, libtpu loaded without opening the
chip) holding the attached chip's generation as a compile-only topology device. It rebuilds a case from its kernel
and id, traces the implementation's function under that device and exports it for the TPU (`jax.export`: StableHLO
with each Pallas kernel already lowered to Mosaic); the chip's process deserializes the module and only compiles it.
Everything a kernel or a baseline reads of the chip while tracing reads the same generation the chip reports: the
default device (`pltpu.get_tpu_info`, the tuning tables) is the topology's device, and `jax.devices()` (which
JAX's ragged paged attention, megablox and vLLM's kernels consult for their tuned tiles) is made to return it.

A program a worker cannot export (an eager array built while making the function, an implementation that donates
its state, a failure of any kind) is lowered in the chip's process as before, so a worker never changes what is
measured, only where its tracing runs; the run says how many programs each side lowered.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import importlib.util
import multiprocessing
import os
import time

from . import deviceless

_device = None  # in a worker: the topology's device
_platform = "tpu"  # in a worker: the platform it exports for (the CPU in the tests, which have no chip to run on)
_resolve = None  # in a worker: kernel name -> its Suite
_shared: Pool | None = None  # in the chip's process: the run's workers, started on first use
_cases: dict[str, dict] = {}  # in a worker: {kernel: {case id: case}}
_generation = None  # in a worker: the chip's generation (a measured sweep's candidate tilings depend on it)


def default_workers(compile_workers: int) -> int:
    """Worker processes for a host: its cores less the compile threads and the thread that runs the chip (6 on the
    v5e host's 13 cores beside 6 compile threads); 0 where that leaves none."""
    return max(0, (os.cpu_count() or 1) - compile_workers - 1)


def _init(topology: str, platform: str, resolve, generation: str) -> None:
    """A worker's setup, before it initializes any JAX backend: deviceless, the chip as a topology device."""
    os.environ.update(deviceless.DEVICELESS_ENV)
    import jax
    from jax.experimental import topologies

    jax.config.update("jax_platforms", "cpu")
    global _device, _platform, _resolve, _generation
    _platform, _resolve, _generation = platform, resolve, generation
    _device = topologies.get_topology_desc(topology, "tpu").devices[0]
    # the peers' tuned-tile lookups read jax.devices()[0].device_kind: the chip's, as in the chip's process
    jax.devices = jax.local_devices = lambda *args, **kwargs: [_device]


def _case(kernel: str, case_id: str):
    """The case of that id: one of the suite's, or a measured sweep's tiling of one (sweep.variant_case)."""
    if kernel not in _cases:
        s = _resolve(kernel)
        _cases[kernel] = {c.id: c for shapes in (None, s.quick_shapes, s.sweep_shapes) for c in s.cases(shapes)}
    if case_id not in _cases[kernel]:
        from . import sweep

        case = sweep.variant_case(_resolve(kernel), case_id, _generation)
        if case is None:
            raise KeyError(f"{kernel}: no case {case_id!r}")
        _cases[kernel][case_id] = case
    return _cases[kernel][case_id]


def export(kernel: str, case_id: str, impl: str | None, make_args, specs) -> tuple[bytes, float]:
    """In a worker: (the serialized jax.export of one program for the TPU, seconds it took). `impl` None: the
    case's input builder `make_args(case)` (no arguments); else the implementation's function on `specs`."""
    import jax

    start = time.perf_counter()
    # Under the chip's device from the start: a sweep's case is rebuilt from its tuning module's candidates, which read
    # the traced-for chip (outside, a worker's jax answers with the default generation's tables).
    with jax.default_device(_device):
        case = _case(kernel, case_id)
        fn = (lambda: make_args(case)) if impl is None else case.op.function(impl, case.shape)
        exported = jax.export.export(jax.jit(fn), platforms=(_platform,))(*specs)
    return exported.serialize(), time.perf_counter() - start


class Pool:
    """Worker processes that export programs for the attached chip's generation (see module docstring)."""

    def __init__(self, generation: str, workers: int, *, platform: str = "tpu", resolve=None):
        """`workers` processes tracing for `generation`'s chip, exporting for `platform`; `resolve(kernel)` gives
        a kernel's Suite (default benchmarks.suite.get; picklable by reference)."""
        from . import perf_model, suite

        self.workers = workers
        self.prefetched: dict[tuple, concurrent.futures.Future] = {}  # (kernel, case id, impl) -> its export
        self.executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),  # never fork a process that holds the chip
            initializer=_init,
            # the generation's deviceless topology (its first device stands for the attached chip)
            initargs=(perf_model.get_chip(generation).topology, platform, resolve or suite.get, generation),
        )

    def submit(self, kernel: str, case_id: str, impl: str | None, make_args, specs) -> concurrent.futures.Future:
        """The program's export: the one prefetched for it, if any (handed over once), else a new one."""
        future = self.prefetched.pop((kernel, case_id, impl), None)
        return future or self.executor.submit(export, kernel, case_id, impl, make_args, specs)

    def prefetch(self, kernel: str, case_id: str, impl: str | None, make_args, specs) -> None:
        """Start a program's export ahead of the run that will ask for it (the next kernel's, while this one is
        measured: the workers are otherwise idle once a kernel's exports are done)."""
        key = (kernel, case_id, impl)
        if key not in self.prefetched:
            self.prefetched[key] = self.executor.submit(export, kernel, case_id, impl, make_args, specs)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def deserialized_call(blob: bytes):
    """The function that runs an exported program (its lowering only wraps the module the worker made), taking the
    arguments the program was exported for and passing on only those its module kept (jax.export drops the unused
    ones from the module, but `Exported.call` still takes them all, so jitted around it they stay parameters of the
    program the chip runs). Unused ones are the rule in a flash attention backward's case, whose arguments hold every
    implementation's residuals: on the v5e, Qwen3's fused backward took 22,922 µs as a program of 30 parameters, the
    other implementations' residuals among them unused, and 20,793 µs as the program of its own 9 (measured, device
    time; the same kernel, compiled alike: the cause on the chip was not found), so the case's program is its own."""
    import jax
    import jax.numpy as jnp

    exported = jax.export.deserialize(bytearray(blob))
    kept = set(exported.module_kept_var_idx)

    def call(*args):
        leaves, tree = jax.tree.flatten(args)
        # a dropped argument's stand-in is dead code the jit around this removes, with the parameter it replaces
        leaves = [x if i in kept else jnp.zeros(jnp.shape(x), x.dtype) for i, x in enumerate(leaves)]
        return exported.call(*jax.tree.unflatten(tree, leaves))

    return call


def shared(generation: str | None, workers: int) -> Pool | None:
    """The run's worker pool (one for every kernel measured: each worker starts jax once), or None where `workers`
    is 0 or the chip's generation has no deviceless topology (everything is lowered in the chip's process then)."""
    from . import perf_model

    global _shared
    if workers <= 0 or generation not in perf_model.GENERATIONS or importlib.util.find_spec("flatbuffers") is None:
        return None  # (jax.export serializes with flatbuffers: where it is missing, nothing is lowered elsewhere)
    if _shared is None or _shared.workers != workers:
        if _shared is not None:
            _shared.close()
        _shared = Pool(generation, workers)
        atexit.register(_shared.close)
    return _shared
