"""Host-side analysis of the pallas_calls in a JAX function.

For each pallas_call found in the jaxpr (also inside jit / custom_vjp / custom_jvp):
  * the concrete scalar-prefetch operands, by evaluating the program on the host
    up to the call (only when the caller gave concrete arrays);
  * every BlockSpec index map evaluated at every grid point (vectorised with vmap),
    from which the HBM bytes the Pallas pipeline moves follow: an input block is
    fetched when its block index differs from the previous grid step's, an output
    block is written back when the next step's index differs (or at the last step);
  * the index of every top-level `cond` in the kernel (`pl.when`) at every grid point
    where it depends only on program ids, so the schedule model can skip the
    bundles of regions that do not run;
  * the logical dot_general flops of one grid step.

Uses jax internals (pallas_call params, GridMapping, BlockMapping): every access is
guarded so that a layout change degrades to a warning, not a crash.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import jax
import numpy as np

from . import dma_shape
from . import kernel_eval as KE

_is_literal = KE.is_literal


_sub_closed_jaxprs = KE.sub_jaxprs


# Recorded beside the pallas_calls: XLA's ragged dot, which XLA lowers to a Mosaic kernel of its own whose grid
# follows from the group sizes (xla_ragged_dot.py).
_RECORDED = ("pallas_call", "ragged_dot_general")


def _holds_recorded(jaxpr) -> bool:
    """Whether `jaxpr` (or one nested in it) holds a pallas_call or an XLA ragged dot: the walk goes into it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _RECORDED:
            return True
        for sub, _ in _sub_closed_jaxprs(eqn):
            if _holds_recorded(sub):
                return True
        for k in ("branches",):
            for br in eqn.params.get(k, ()) or ():
                if _holds_recorded(br.jaxpr):
                    return True
    return False


_INTERPRET_MAX_INPUT_BYTES = 1 << 20
# The TPU interpreter keeps global state (its simulated memories): one interpreted call at a time, even when
# callers model several programs from threads (benchmarks/modeled.py).
_INTERPRET_LOCK = threading.Lock()


def _bind_on_cpu(eqn, invals, **param_overrides):
    """eqn's primitive applied to concrete invals on the host CPU: its outputs as a list, or None if that fails
    (unknown values are allowed)."""
    try:
        bind_params = eqn.primitive.get_bind_params(eqn.params)
        subfuns = ()
        if isinstance(bind_params, tuple):  # jax < 0.10: (subfuns, params); later: params (subfuns inside)
            subfuns, bind_params = bind_params
        with jax.default_device(jax.devices("cpu")[0]):
            outs = eqn.primitive.bind(*subfuns, *invals, **dict(bind_params, **param_overrides))
    except Exception:  # noqa: BLE001
        return None
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _interpret_small_call(eqn, invals):
    """Outputs of a pallas_call whose inputs are all concrete and small (e.g. a kernel that computes another kernel's
    scalar-prefetch metadata), run in TPU interpret mode on the host; else None (unknown)."""
    if any(x is None for x in invals) or sum(np.asarray(x).nbytes for x in invals) > _INTERPRET_MAX_INPUT_BYTES:
        return None
    from jax.experimental.pallas import tpu as pltpu

    with _INTERPRET_LOCK:
        outs = _bind_on_cpu(eqn, invals, interpret=pltpu.InterpretParams())
        return None if outs is None else [np.asarray(x) for x in outs]


def _walk(jaxpr, consts, args, records, warnings):
    """Evaluate `jaxpr` on the host (values may be None = unknown); record pallas_calls."""
    env: dict[Any, Any] = {}

    def read(v):
        if _is_literal(v):
            return v.val
        return env.get(v)

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = None
        name = eqn.primitive.name
        if name == "pallas_call":
            records.append((eqn, invals))
            outs = _interpret_small_call(eqn, invals)
        elif name == "ragged_dot_general":
            records.append((eqn, invals))
            if all(x is not None for x in invals):
                outs = _bind_on_cpu(eqn, invals)
        else:
            subs = _sub_closed_jaxprs(eqn)
            if subs and _holds_recorded(subs[0][0]):
                sub, sub_consts = subs[0]
                outs = _walk(sub, sub_consts, invals, records, warnings)
            elif any(_holds_recorded(br.jaxpr) for br in eqn.params.get("branches", ()) or ()):
                warnings.append(f"pallas_call or ragged dot inside `{name}`: not analysed")
            elif all(x is not None for x in invals):
                outs = _bind_on_cpu(eqn, invals)
        if outs is None:
            outs = [None] * len(eqn.outvars)
        for v, o in zip(eqn.outvars, outs):
            if type(v).__name__ != "DropVar":
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


@dataclasses.dataclass
class BlockTraffic:
    origin: str
    kind: str  # "input" | "output"
    block_shape: tuple
    array_shape: tuple
    dtype: str
    transfers: int  # number of block DMAs
    bytes: int  # total bytes moved for this operand by the BlockSpec pipeline
    exact: bool  # False when the index map could not be evaluated
    memory_space: str = "vmem"  # "vmem": pipelined by BlockSpecs (counted here); "smem", "any" (manual DMAs),
    # "semaphore": not pipelined, so 0 here; the model counts what the schedule's DMAs move for them
    runs_per_transfer: int = 1  # contiguous runs in HBM of one block DMA (dma_shape.hbm_runs)


@dataclasses.dataclass
class RaggedDotInfo:
    """An XLA ragged dot in the program (rows of lhs [m, k] in groups, rhs [groups, k, n]): its group sizes where the
    program's concrete inputs decide them, else None."""

    lhs_shape: tuple
    rhs_shape: tuple
    group_sizes: np.ndarray | None


def _ragged_dot_info(eqn, invals) -> RaggedDotInfo | None:
    """The forward form only (lhs [m, k] rows ragged, rhs grouped on its first axis, contracting lhs 1 with rhs 1 or,
    rhs stored [groups, n, k], with rhs 2): the one whose kernel xla_ragged_dot.py reads (XLA relays a [groups, n, k]
    rhs out to [groups, k, n] first, a copy of its own). rhs_shape is given as [groups, k, n]."""
    numbers = eqn.params.get("ragged_dot_dimension_numbers")
    try:
        contracting = tuple(map(tuple, numbers.dot_dimension_numbers[0]))
        forward = (
            tuple(numbers.lhs_ragged_dimensions) == (0,)
            and tuple(numbers.rhs_group_dimensions) == (0,)
            and contracting in (((1,), (1,)), ((1,), (2,)))
            and not any(numbers.dot_dimension_numbers[1])
        )
    except (AttributeError, TypeError, IndexError):
        return None
    if not forward or eqn.params.get("group_offset") is not None:
        return None
    lhs, rhs = (tuple(v.aval.shape) for v in eqn.invars[:2])
    if len(lhs) != 2 or len(rhs) != 3:
        return None
    if contracting[1] == (2,):
        rhs = (rhs[0], rhs[2], rhs[1])
    sizes = invals[2]
    return RaggedDotInfo(lhs, rhs, None if sizes is None else np.asarray(sizes))


@dataclasses.dataclass
class PallasCallInfo:
    name: str  # kernel name (name_and_src_info)
    grid: tuple[int, ...]
    steps: int
    in_bytes: np.ndarray  # per grid step: bytes fetched for this step's inputs
    out_bytes: np.ndarray  # per grid step: bytes written back after this step
    in_dmas: np.ndarray  # per grid step: block DMAs fetching this step's inputs
    out_dmas: np.ndarray  # per grid step: block DMAs writing back after this step
    in_runs: np.ndarray  # per grid step: contiguous HBM runs of those DMAs
    out_runs: np.ndarray
    blocks: list[BlockTraffic]
    cost_estimate: dict | None
    warnings: list[str]
    runtime_loops: bool = False  # the kernel body holds a while loop (e.g. a fori_loop to a traced bound)
    evaluated: KE.KernelEval | None = None  # its control flow and manual DMAs per step (None: not evaluated)

    @property
    def cond_taken(self) -> list:
        """Per grid-level conditional region, program order: bool per step (True = it runs), or None."""
        return self.evaluated.conds if self.evaluated else []

    @property
    def dot_flops_per_step(self) -> np.ndarray:
        return self.evaluated.dot_flops if self.evaluated else np.zeros(self.steps)


def _block_sizes(bm) -> list[tuple[str, int]]:
    out = []
    for d in bm.block_shape:
        if d is None:
            out.append(("squeezed", 1))
        elif isinstance(d, int):
            out.append(("blocked", d))
        else:
            cls = type(d).__name__.lower()
            size = getattr(d, "block_size", 1)
            if "squeezed" in cls:
                out.append(("squeezed", 1))
            elif "element" in cls:
                out.append(("element", int(size)))
            else:
                out.append(("blocked", int(size)))
    return out


def _memory_space_name(bm) -> str:
    for attr in ("transformed_block_aval", "block_aval"):
        aval = getattr(bm, attr, None)
        ms = getattr(aval, "memory_space", None)
        if ms is not None:
            return str(ms).lower()
    return ""


def _grid_points(grid):
    steps = int(np.prod(grid)) if grid else 1
    if not grid:
        return steps, []
    idx = np.indices(grid).reshape(len(grid), -1)  # row-major: last axis fastest
    return steps, [idx[i].astype(np.int32) for i in range(len(grid))]


def _uses_invars(jaxpr, invars) -> bool:
    s = set(invars)
    for eqn in jaxpr.eqns:
        if any((not _is_literal(v)) and v in s for v in eqn.invars):
            return True
    return any((not _is_literal(v)) and v in s for v in jaxpr.outvars)


def _eval_index_map(bm, pids, scalars, steps):
    cj = bm.index_map_jaxpr
    n_grid = len(pids)

    n_out = len(cj.jaxpr.outvars)
    if scalars:
        # Scalar-prefetch operands reach the index map as Refs: discharge them into values.
        # Private API (jax._src.state.discharge), guarded: without it, maps that read scalar
        # prefetch refs cannot be evaluated.
        try:
            from jax._src.state.discharge import discharge_state

            try:
                cj = discharge_state(cj)
            except TypeError:  # older signature: (jaxpr, consts) -> (jaxpr, consts)
                dj, dc = discharge_state(cj.jaxpr, cj.consts)
                cj = type(cj)(dj, dc)
        except ImportError:  # pragma: no cover
            pass
    try:
        from jax.extend.core import jaxpr_as_fun  # public

        g = jaxpr_as_fun(cj)
    except ImportError:  # pragma: no cover
        g = lambda *a: jax.core.eval_jaxpr(cj.jaxpr, cj.consts, *a)  # noqa: E731

    def f(*p):
        return g(*p, *scalars)[:n_out]

    with jax.default_device(jax.devices("cpu")[0]):
        if n_grid == 0:
            outs = f()
            return (
                np.stack([np.broadcast_to(np.asarray(o), (steps,)) for o in outs], axis=1)
                if outs
                else np.zeros((steps, 0), np.int32)
            )
        outs = jax.jit(jax.vmap(f))(*pids)
    return np.stack([np.asarray(o).reshape(steps) for o in outs], axis=1) if outs else np.zeros((steps, 0), np.int32)


def block_bytes(starts, block_shape, array_shape, itemsize) -> np.ndarray:
    """Per grid step, the bytes of a block whose first element along each dimension is `starts` [steps, dims]: a block
    at the array's edge holds only its part inside."""
    nbytes = np.full(len(starts), itemsize, np.int64 if float(itemsize).is_integer() else np.float64)
    for d, (size, dim) in enumerate(zip(block_shape, array_shape)):
        nbytes = nbytes * np.clip(dim - starts[:, d], 0, size)
    return nbytes


def block_moves(idx, kind: str) -> np.ndarray:
    """Per grid step, whether a BlockSpec-pipelined block moves (its block index idx [steps, dims]): an input block is
    fetched when its index differs from the previous step's, an output block written back when the next step's
    differs (or at the last step)."""
    changed = np.ones(len(idx), bool)
    if len(idx) > 1:
        differs = np.any(idx[1:] != idx[:-1], axis=1)
        if kind == "input":
            changed[1:] = differs
        else:
            changed[:-1] = differs
    return changed


def analyze_pallas_calls(fn, args, trace_device=None) -> tuple[list[PallasCallInfo], list[str], list[RaggedDotInfo]]:
    """Find and analyse every pallas_call in fn(*args). Returns (calls, warnings, the program's XLA ragged dots in
    program order).

    trace_device: default device while tracing fn (the target generation's topology device), so that
    kernels choosing block sizes from the chip they are traced for trace the program that is compiled.
    """
    warnings: list[str] = []
    leaves = jax.tree.leaves(args)
    # Concrete leaves are evaluated on the host; ShapeDtypeStruct leaves are unknown (None): a program may mix them
    # (e.g. concrete group sizes beside abstract matrices), and what depends only on concrete leaves is exact.
    is_concrete = lambda x: isinstance(x, (np.ndarray, jax.Array, np.generic, int, float))  # noqa: E731
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x, args)
    if trace_device is None:
        closed = jax.make_jaxpr(fn)(*specs)
    else:
        with jax.default_device(trace_device):
            closed = jax.make_jaxpr(fn)(*specs)
    flat = [np.asarray(x) if is_concrete(x) else None for x in leaves]
    records: list = []
    _walk(closed.jaxpr, list(closed.consts), flat, records, warnings)
    infos, ragged_dots = [], []
    for eqn, invals in records:
        if eqn.primitive.name == "pallas_call":
            infos.append(_analyze_one(eqn, invals, warnings))
        elif (info := _ragged_dot_info(eqn, invals)) is not None:
            ragged_dots.append(info)
    return infos, warnings, ragged_dots


def _analyze_one(eqn, invals, global_warnings) -> PallasCallInfo:
    p = eqn.params
    gm = p["grid_mapping"]
    warnings: list[str] = []
    name = p.get("name") or getattr(p.get("name_and_src_info"), "name", None) or "pallas_call"  # jax 0.10: name
    grid = tuple(gm.grid)
    n_dyn = sum(1 for g in grid if not isinstance(g, (int, np.integer)))
    if n_dyn:
        dyn = [int(np.asarray(v)) if v is not None else None for v in invals[:n_dyn]]
        if any(v is None for v in dyn):
            raise ValueError(f"{name}: dynamic grid bounds need concrete inputs")
        it = iter(dyn)
        grid = tuple(g if isinstance(g, (int, np.integer)) else next(it) for g in grid)
    grid = tuple(int(g) for g in grid)
    steps, pids = _grid_points(grid)
    nidx = gm.num_index_operands
    scalars = invals[n_dyn : n_dyn + nidx]
    scalars_known = all(s is not None for s in scalars)
    in_bytes = np.zeros(steps, np.int64)
    out_bytes = np.zeros(steps, np.int64)
    dmas = {"input": np.zeros(steps, np.int64), "output": np.zeros(steps, np.int64)}
    runs = {"input": np.zeros(steps, np.int64), "output": np.zeros(steps, np.int64)}
    blocks = []
    # Kernel operands whose contents are known at every step (for conditions on data): scalar prefetch, and the
    # blocks of concrete inputs. The kernel's operands are the scalar prefetch, then one per block mapping.
    known = {i: KE.KnownRef(v) for i, v in enumerate(scalars) if v is not None}
    for i, bm in enumerate(gm.block_mappings):
        kind = "input" if i < gm.num_inputs else "output"
        arr = tuple(bm.array_aval.shape)
        dtype = np.dtype(bm.array_aval.dtype)
        itemsize = dtype.itemsize
        origin = str(getattr(bm, "origin", f"{kind}{i}"))
        ms = _memory_space_name(bm)
        sizes = _block_sizes(bm)
        space = "any" if "any" in ms or "hbm" in ms else next((k for k in ("semaphore", "smem") if k in ms), "vmem")
        if space != "vmem":
            # Not pipelined by BlockSpecs: an SMEM operand is copied whole around the kernel body, an ANY/HBM one is
            # moved by the kernel's own DMAs. Both are DMA instructions of the compiled schedule, counted there.
            shape = tuple(s for _, s in sizes)
            blocks.append(BlockTraffic(origin, kind, shape, arr, str(dtype), 0, 0, False, space))
            operand = invals[n_dyn + nidx + i] if kind == "input" else None
            if space == "smem" and operand is not None and shape == arr:
                known[nidx + i] = KE.KnownRef(operand)
            continue
        idx_invars = bm.index_map_jaxpr.jaxpr.invars[len(grid) :]
        exact = True
        if nidx and not scalars_known and _uses_invars(bm.index_map_jaxpr.jaxpr, idx_invars):
            exact = False
            warnings.append(
                f"{origin}: index map reads scalar prefetch but inputs are not concrete; counted as fetched every step"
            )
            changed = np.ones(steps, bool)
            per_step = np.full(steps, math.prod(s for _, s in sizes) * itemsize, np.int64)
        else:
            sc = [np.asarray(s) for s in scalars] if nidx else []
            idx = _eval_index_map(bm, pids, sc, steps)
            starts = idx.astype(np.int64) * np.array([bs if k == "blocked" else 1 for k, bs in sizes], np.int64)
            per_step = block_bytes(starts, [bs for _, bs in sizes], arr, itemsize)
            operand = invals[n_dyn + nidx + i] if kind == "input" else None
            if operand is not None:
                known[nidx + i] = KE.KnownRef(operand, idx, sizes)
            changed = block_moves(idx, kind)
        moved = per_step * changed
        if kind == "input":
            in_bytes += moved
        else:
            out_bytes += moved
        block_runs = dma_shape.hbm_runs(arr, [min(s, dim) for (_, s), dim in zip(sizes, arr)], itemsize)
        dmas[kind] += changed
        runs[kind] += changed * block_runs
        blocks.append(
            BlockTraffic(
                origin,
                kind,
                tuple(s for _, s in sizes),
                arr,
                str(dtype),
                int(changed.sum()),
                int(moved.sum()),
                exact,
                runs_per_transfer=block_runs,
            )
        )
    kjaxpr = p["jaxpr"]
    kjaxpr = getattr(kjaxpr, "jaxpr", kjaxpr)
    try:
        evaluated = KE.evaluate_kernel(kjaxpr, grid, pids if pids else [], steps, known)
        warnings += evaluated.warnings
    except Exception as e:  # noqa: BLE001
        warnings.append(f"kernel control flow not evaluated ({type(e).__name__}: {e})")
        evaluated = None
    ce = p.get("cost_estimate")
    ce = None if ce is None else {k: getattr(ce, k, None) for k in ("flops", "transcendentals", "bytes_accessed")}
    global_warnings.extend(f"{name}: {w}" for w in warnings)
    runtime_loops = _has_while(kjaxpr)
    return PallasCallInfo(
        name,
        grid,
        steps,
        in_bytes,
        out_bytes,
        dmas["input"],
        dmas["output"],
        runs["input"],
        runs["output"],
        blocks,
        ce,
        warnings,
        runtime_loops,
        evaluated,
    )


def _has_while(jaxpr) -> bool:
    """Whether a while loop (trip count decided at run time; fori_loops with static bounds trace to scan or to a
    while whose bounds are literals, which Mosaic unrolls into a counted loop) appears anywhere in `jaxpr`."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while" and not KE.static_fori(eqn):
            return True
        if any(_has_while(j) for j in KE.all_sub_jaxprs(eqn)):
            return True
    return False
