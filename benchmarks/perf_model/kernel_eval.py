"""Evaluate a Pallas kernel's scalar control flow on the host, for every grid step at once.

What the schedule cannot say is decided here, from the kernel's jaxpr and the concrete inputs:
  * which conditional regions run at each step (`pl.when`, if/else, switch), on program ids, scalar prefetch and the
    blocks of concrete inputs;
  * how many times each loop runs (`fori_loop`, `scan`, `while`), also when its bounds are run-time values;
  * the manual DMAs (`make_async_copy`, and `emit_pipeline`, which is made of them): every `dma_start` is counted
    with the bytes of its slice, at every iteration of the loops around it, under the conditions that guard it.

Values are numpy arrays with the grid step as leading axis (a scalar is shape (steps,)), or None when unknown. Only
small values are evaluated (scalars, index vectors): the kernel's vector work is not, it is the schedule's business.
Primitives without a numpy rule are applied with jax (vmapped over the steps), which is slow but rare.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from . import dma_shape

# Values with more elements per step than this are not evaluated (the kernel's vector data, not its control flow).
_MAX_ELEMENTS = 4096
# Loop iterations evaluated one by one per kernel, summed over all loops; past it a loop's body is evaluated once with
# unknown carries and its trips taken from its bounds when they are known (tokamax's largest shapes run ~10^4).
_MAX_ITERATIONS = 5_000_000
# Iterations a loop too long for the budget is sampled for, at least (its trip count known, the sample is scaled).
_MIN_SAMPLE = 1024
# Equations evaluated per kernel, every one counted (those in conditionals and nested loops too), past which an
# outermost loop with a known trip count stops at the end of its current iteration and is scaled from the iterations
# it ran (a while loop of unknown trips, at twice as many, is left with its trips unknown): the loop budget above
# counts a loop body's own equations only, and a kernel with branches and loops inside its loops (vLLM's fused MoE)
# took minutes (~60k equations a second).
_MAX_EVALUATED = 3_000_000

_INT_DIV = {
    "div": lambda a, b: np.where(b != 0, np.trunc(np.true_divide(a, np.where(b == 0, 1, b))), 0).astype(
        np.result_type(a, b)
    ),
    "rem": lambda a, b: np.fmod(a, np.where(b == 0, 1, b)),
}
# Hints and barriers: their value is their operand's (pl.multiple_of is in every emit_pipeline index computation).
_IDENTITY = ("multiple_of", "optimization_barrier", "copy", "copy_p")
_NUMPY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "not": lambda a: np.logical_not(a) if a.dtype == bool else np.invert(a),
    "neg": np.negative,
    "abs": np.abs,
    "sign": np.sign,
    "shift_left": np.left_shift,
    "shift_right_arithmetic": np.right_shift,
}


class KnownRef:
    """A kernel ref whose contents are known on the host: a scalar-prefetch operand or an SMEM input (the whole
    array), or a concrete input's block (`block_index`: the block's index per step and array dimension; `dims`:
    (kind, size) per array dimension as the BlockSpec gives them; squeezed dimensions are not indexed in the kernel)."""

    def __init__(self, value, block_index=None, dims=None):
        self.value = np.asarray(value)
        self.block_index = block_index
        self.dims = dims


@dataclasses.dataclass
class Construct:
    """A loop or a conditional region of the kernel, in program order (the order of their code in the schedule).
    `executions`: per grid step, a loop's iterations or a region's runs, summed over every execution of the code
    around it (None: unknown). `runtime`: a loop whose bounds are run-time values (a while loop, or a fori to a traced
    bound), i.e. with no trip count in the schedule. `depth`: the loops around it."""

    kind: str  # "loop" | "region"
    runtime: bool
    executions: np.ndarray | None
    depth: int
    vector_work: bool = False  # a region whose code does vector work itself (not only scalar bookkeeping and DMA
    # issue, which the compiler predicates instead of branching over): the regions the schedule keeps as branches
    dots: bool = False  # a region whose code has matmuls itself (vmatmuls in the schedule)
    loops: bool = False  # a region with a loop in it
    predicable: bool = False  # its code, nested conditionals included, is scalar work and DMA starts/waits only: the
    # compiler may if-convert it (predicated instructions inline in the enclosing code) instead of branching over it
    nests: bool = False  # a region with a conditional in it
    dots_within: bool = False  # a region with matmuls anywhere in its code (nested conditionals included)
    described: bool = False  # the facts above have been read from its code


@dataclasses.dataclass
class KernelEval:
    conds: list  # per grid-level conditional region, program order: bool per step (False = skipped) or None
    cond_regions: list  # the Construct of each of `conds` (what its code holds), same order
    dot_flops: np.ndarray  # logical dot_general flops per step
    dma_in: np.ndarray  # manual DMA bytes from HBM per step
    dma_out: np.ndarray  # manual DMA bytes to HBM per step
    dma_count: np.ndarray  # manual DMAs issued per step (HBM <-> on-chip)
    dma_runs: np.ndarray  # their contiguous runs in HBM per step (dma_shape.hbm_runs of each DMA's HBM-side slice)
    remote_bytes: np.ndarray  # DMAs to another device (ICI), per step; not HBM traffic of this core
    constructs: list[Construct]
    pipeline_steps: np.ndarray  # iterations per step of the loops that both start and wait on DMAs themselves (a
    # manual pipeline's steps: emit_pipeline's loop, a fori_loop of copies), each paying the chip's per-step cost
    one_way_iterations: np.ndarray  # iterations per step of the loops that only start DMAs or only wait on them (a
    # batch of DMAs issued by one loop, drained by another): their cycles and DMA time, no per-step cost
    dmas_upper: bool = False  # a DMA under a condition the model cannot see: counted as issued
    dmas_lower: bool = False  # a DMA in a loop whose trips are unknown: counted once
    extrapolated: bool = False  # a loop too long to evaluate whole: a sample of its iterations, scaled to its trips
    warnings: list = dataclasses.field(default_factory=list)

    @property
    def loops(self) -> list[Construct]:
        return [c for c in self.constructs if c.kind == "loop"]


def is_literal(x) -> bool:
    return type(x).__name__ == "Literal" or (hasattr(x, "val") and not hasattr(x, "count"))


def _memory_space(aval) -> str:
    ms = getattr(aval, "memory_space", None)
    if ms is None and hasattr(aval, "ref"):
        ms = getattr(aval.ref, "memory_space", None)
    return str(ms).lower() if ms is not None else ""


def _is_hbm(space: str) -> bool:
    return "any" in space or "hbm" in space


class _Evaluator:
    def __init__(self, grid, pids, steps, warnings):
        self.grid, self.pids, self.steps = grid, pids, steps
        self.warnings = warnings
        self.conds: list = []
        self.cond_regions: list[Construct] = []
        self.flops = np.zeros(steps, np.float64)
        self.dma_in = np.zeros(steps, np.float64)
        self.dma_out = np.zeros(steps, np.float64)
        self.dma_count = np.zeros(steps, np.float64)
        self.dma_runs = np.zeros(steps, np.float64)
        self.remote = np.zeros(steps, np.float64)
        self.pipeline_steps = np.zeros(steps, np.float64)
        self.one_way_iterations = np.zeros(steps, np.float64)
        self.constructs: list[Construct] = []
        self._by_key: dict = {}
        self._facts: dict = {}  # id(eqn) -> facts (the eqn is kept in them, so the id stays its own)
        self._literals: dict = {}  # id(literal) -> (literal, its per-step array)
        self.depth = 0
        self.dmas_upper = self.dmas_lower = False
        self.extrapolated = False  # a loop too long to evaluate whole was sampled and scaled
        self.budget = _MAX_ITERATIONS
        self.evaluated = 0  # equations evaluated so far (`_MAX_EVALUATED`)

    # ------------------------------------------------------------------ values
    def _small(self, aval) -> bool:
        shape = getattr(aval, "shape", None)
        return shape is not None and math.prod(shape) <= _MAX_ELEMENTS and not hasattr(aval, "inner_aval")  # not a ref

    def _apply(self, eqn, invals):
        name = eqn.primitive.name
        try:
            if name in _NUMPY:
                return [np.asarray(_NUMPY[name](*invals))]
            if name in _INT_DIV and all(np.issubdtype(x.dtype, np.integer) for x in invals):
                return [np.asarray(_INT_DIV[name](*invals))]
            if name == "select_n":
                which, *cases = invals
                return [np.choose(np.asarray(which).astype(np.int64), np.broadcast_arrays(*cases))]
            if name == "convert_element_type":
                return [np.asarray(invals[0]).astype(np.dtype(eqn.params["new_dtype"]))]
            if name in _IDENTITY:
                return list(invals)
            if name == "integer_pow":
                return [np.power(invals[0], eqn.params["y"])]
            if name == "clamp":
                lo, x, hi = invals
                return [np.clip(x, lo, hi)]
        except Exception:  # noqa: BLE001 - fall back to jax
            pass
        return self._bind(eqn, invals)

    def _bind(self, eqn, invals):
        try:
            prim = eqn.primitive
            bind_params = prim.get_bind_params(eqn.params)
            subfuns = ()
            if isinstance(bind_params, tuple):  # jax < 0.10: (subfuns, params)
                subfuns, bind_params = bind_params
            with jax.default_device(jax.devices("cpu")[0]):
                res = jax.vmap(lambda *a: prim.bind(*subfuns, *a, **bind_params))(*invals)
            outs = list(res) if prim.multiple_results else [res]
            return [np.asarray(o) for o in outs]
        except Exception:  # noqa: BLE001
            return None

    # ------------------------------------------------------------------ refs
    def _read_ref(self, eqn, ref: KnownRef, leaves):
        """A `get` of scalars from a known ref at every step (None for a slice or an unexpected indexer layout)."""
        if any(x is None for x in leaves):
            return None
        try:
            indexers = jax.tree_util.tree_unflatten(eqn.params["tree"], leaves)
            if ref.block_index is not None and len(indexers) != 1:
                return None
            value = ref.value
            for indexer in indexers:
                idx = indexer.indices
                if any(not isinstance(i, np.ndarray) for i in idx):
                    return None  # a slice: not a scalar read
                idx = [np.broadcast_to(i, (self.steps,)).astype(np.int64) for i in idx]
                if ref.block_index is not None:
                    idx = _absolute_index(ref, idx)
                    if idx is None:
                        return None
                value = value[tuple(idx)]
            return np.asarray(value).reshape(self.steps)
        except Exception:  # noqa: BLE001 - another jax's indexer layout: unknown
            return None

    def _dma_bytes(self, eqn, src, read):
        """Bytes of a DMA's slice, per step when its size is a run-time value (`pl.ds(start, size)` with a traced
        size: read from the evaluated operands, else the whole dimension, an upper bound)."""
        itemsize = np.dtype(src.dtype).itemsize
        if all(isinstance(d, (int, np.integer)) for d in src.shape):
            return math.prod(src.shape) * itemsize
        values = [v.aval if hasattr(v.aval, "inner_aval") else read(v) for v in eqn.invars]
        src_values = eqn.params["tree"].unflatten(values)[0]
        indexers = [t for t in getattr(src_values, "transforms", ()) if hasattr(t, "indices")]
        if len(indexers) != 1 or len(getattr(src_values, "transforms", ())) != 1:
            raise TypeError("a DMA slice of run-time size behind other transforms")
        full = src_values.ref.shape
        nbytes = np.full(self.steps, itemsize, np.float64)
        for dim, index in zip(full, indexers[0].indices):
            if type(index).__name__ != "Slice":
                continue  # an integer index: that dimension is dropped
            size = index.size
            if isinstance(size, (int, np.integer)):
                nbytes = nbytes * int(size)
            elif isinstance(size, np.ndarray):
                nbytes = nbytes * np.broadcast_to(size, (self.steps,))
            else:
                self.dmas_upper = True
                nbytes = nbytes * dim
        return nbytes

    def _dma(self, eqn, weight, sure, read):
        try:
            src, dst, _, _, device_id = eqn.params["tree"].unflatten([v.aval for v in eqn.invars])
            nbytes = self._dma_bytes(eqn, src, read)
        except Exception as e:  # noqa: BLE001 - another jax's DMA layout
            self.warnings.append(f"a manual DMA could not be sized ({type(e).__name__}: {e}): not counted")
            return
        if not sure.all():
            self.dmas_upper = True
        if device_id is not None:
            self.remote += weight * nbytes
            return
        s_hbm, d_hbm = _is_hbm(_memory_space(src)), _is_hbm(_memory_space(dst))
        if s_hbm:
            self.dma_in += weight * nbytes
        if d_hbm:
            self.dma_out += weight * nbytes
        if s_hbm or d_hbm:
            self.dma_count += weight
            self.dma_runs += weight * _runs(src if s_hbm else dst)

    # ------------------------------------------------------------------ walk
    def _eqn_facts(self, eqn):
        """(primitive name, called jaxprs, whether it is effect-free with small outputs), computed once per eqn: loop
        bodies are evaluated thousands of times."""
        facts = self._facts.get(id(eqn))
        if facts is None:
            small = not eqn.effects and all(self._small(v.aval) for v in eqn.outvars)
            facts = self._facts[id(eqn)] = (eqn.primitive.name, sub_jaxprs(eqn), small, eqn)
        return facts[:3]

    def run(self, jaxpr, env, weight, sure, grid_level, consts=()):
        """Evaluate `jaxpr` (env: invar -> value). weight: times it runs per step (0 where it does not); sure: steps
        where that is known (False under a condition the model cannot see). grid_level: outside every loop, where its
        conditionals are regions of the grid step in the schedule. Returns its outputs."""
        env = dict(env)
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c

        literals = self._literals

        def read(v):
            if is_literal(v):
                key = id(v)
                if key not in literals:
                    literals[key] = (v, np.broadcast_to(np.asarray(v.val), (self.steps,) + np.shape(v.val)))
                return literals[key][1]
            return env.get(v)

        self.evaluated += len(jaxpr.eqns)
        for eqn in jaxpr.eqns:
            name, subs, small_outs = self._eqn_facts(eqn)
            outs = None
            if name == "program_id":
                outs = [self.pids[eqn.params["axis"]]]
            elif name == "num_programs":
                outs = [np.full(self.steps, self.grid[eqn.params["axis"]], np.int32)]
            elif name == "dot_general":
                self.flops += weight * _dot_flops(eqn)
            elif name == "get" and isinstance(env.get(eqn.invars[0]), KnownRef):
                value = self._read_ref(eqn, env[eqn.invars[0]], [read(v) for v in eqn.invars[1:]])
                outs = None if value is None else [value]
            elif name == "dma_start":
                self._dma(eqn, weight, sure, read)
            elif name == "cond":
                outs = self._cond(eqn, read, env, weight, sure, grid_level)
            elif name == "scan":
                outs = self._in_loop(self._scan_body, eqn, read, env, weight, sure)
            elif name == "while":
                outs = self._in_loop(self._while_body, eqn, read, env, weight, sure)
            elif name == "run_scoped":
                # Its operands are the body's constvars; its invars are the scratch it allocates (unknown).
                body = eqn.params["jaxpr"]
                consts = [_pass(env, read, v) for v in eqn.invars]
                outs = self.run(body, {}, weight, sure, grid_level, consts)
            elif subs:
                # A call (jit-wrapped jnp function, custom_jvp/vjp...): evaluate it inline.
                sub, sub_consts = subs[0]
                outs = self.run(
                    sub,
                    _bind_invars(sub, [_pass(env, read, v) for v in eqn.invars]),
                    weight,
                    sure,
                    grid_level,
                    sub_consts,
                )
            elif small_outs:
                invals = [read(v) for v in eqn.invars]
                if invals and all(isinstance(x, np.ndarray) for x in invals):
                    outs = self._apply(eqn, invals)
            if outs is not None:
                for v, o in zip(eqn.outvars, outs):
                    if type(v).__name__ != "DropVar":
                        env[v] = o
        return [_pass(env, read, v) for v in jaxpr.outvars]

    def _cond(self, eqn, read, env, weight, sure, grid_level):
        """Regions as Mosaic lowers a cond: `if idx != 0 {cond(idx - 1, branches[1:])} else {branches[0]}`; an empty
        branch makes no region. Branch outputs are merged per step when the index is known."""
        idx = read(eqn.invars[0])
        branches = eqn.params["branches"]
        operands = [_pass(env, read, v) for v in eqn.invars[1:]]
        if idx is None:
            if grid_level:
                self.warnings.append(
                    "a pl.when/cond depends on data the model cannot see: its region is modeled as run"
                )
        else:
            idx = np.asarray(idx).reshape(self.steps).astype(np.int64)
        results = self._cond_cascade(idx, 0, branches, operands, weight, sure, grid_level)
        if idx is None or any(r is None for r in results):
            return None
        return results

    def _cond_cascade(self, idx, offset, branches, operands, weight, sure, grid_level):
        """Branches[i] runs where idx == offset + i (the last one also above). Returns the merged outputs."""

        def region(runs, which):
            code = branches[1:] if which == "then" else branches[:1]
            rec = self._construct((id(branches), offset, which), "region", False)
            if grid_level:
                self.conds.append(None if runs is None else ((weight == 0) | runs))
                self.cond_regions.append(rec)
            if not rec.described:  # facts of its code, read once (a region in a loop is evaluated at every trip)
                rec.vector_work = any(_vector_work(b.jaxpr) for b in code)
                rec.dots = any(_vector_work(b.jaxpr, dots_only=True) for b in code)
                rec.loops = any(_has_loop(b.jaxpr) for b in code)
                rec.predicable = all(_predicable(b.jaxpr) for b in code)
                # A cascade's "then" region holds the rest of the cascade: a conditional in it.
                rec.nests = (which == "then" and len(branches) > 2) or any(_has_cond(b.jaxpr) for b in code)
                rec.dots_within = any(_has_dot(b.jaxpr) for b in code)
                rec.described = True
            if rec.executions is not None:
                rec.executions = None if runs is None else rec.executions + weight * runs

        def within(runs):
            """(weight, sure) of code that runs where `runs` (None: unknown, counted as run, not sure)."""
            return (weight, np.zeros_like(sure)) if runs is None else (weight * runs, sure)

        def walk(branch, runs):
            w, s = within(runs)
            return self.run(branch.jaxpr, _bind_invars(branch.jaxpr, operands), w, s, grid_level, branch.consts)

        then_runs = None if idx is None else idx != offset
        region(then_runs, "then")
        if len(branches) > 2:
            then_out = self._cond_cascade(idx, offset + 1, branches[1:], operands, *within(then_runs), grid_level)
        else:
            then_out = walk(branches[1], then_runs)
        else_runs = None if idx is None else idx == offset
        if branches[0].jaxpr.eqns:
            region(else_runs, "else")
        else_out = walk(branches[0], else_runs)
        if idx is None:
            return [None] * len(then_out)
        merged = []
        for t, e in zip(then_out, else_out):
            if not isinstance(t, np.ndarray) or not isinstance(e, np.ndarray):
                merged.append(None)
                continue
            mask = then_runs.reshape((self.steps,) + (1,) * (t.ndim - 1))
            merged.append(np.where(mask, t, e))
        return merged

    def _construct(self, key, kind, runtime, depth=None):
        """The record of one loop or region of the kernel (one per construct, however often its code is evaluated),
        in the order first met, which is program order."""
        rec = self._by_key.get(key)
        if rec is None:
            depth = self.depth if depth is None else depth
            rec = self._by_key[key] = Construct(kind, runtime, np.zeros(self.steps, np.float64), depth)
            self.constructs.append(rec)
        return rec

    def _loop_record(self, eqn, runtime):
        return self._construct(id(eqn), "loop", runtime, depth=self.depth - 1)  # called inside its own body

    def _in_loop(self, evaluate, eqn, read, env, weight, sure):
        """`evaluate` a loop eqn one loop deeper (the depth of the constructs met inside it)."""
        self.depth += 1
        try:
            return evaluate(eqn, read, env, weight, sure)
        finally:
            self.depth -= 1

    def _scan_body(self, eqn, read, env, weight, sure):
        p = eqn.params
        body = p["jaxpr"]
        n_consts, n_carry, length = p["num_consts"], p["num_carry"], int(p["length"])
        vals = [_pass(env, read, v) for v in eqn.invars]
        consts, carry, xs = vals[:n_consts], vals[n_consts : n_consts + n_carry], vals[n_consts + n_carry :]
        rec = self._loop_record(eqn, runtime=False)
        if rec.executions is not None:
            rec.executions = rec.executions + weight * length
        self._count_dma_loop(body.jaxpr, weight * length)
        cost = max(1, len(body.jaxpr.eqns))
        # Too long to evaluate whole: a sample of its iterations, scaled to its length (as for a long fori_loop).
        sample = length
        if length * cost > self.budget // 2:
            sample = int(max(1, min(length, max(_MIN_SAMPLE, self.budget // 2 // cost))))
        self.budget -= sample * cost
        # The outermost loops may be cut short by the evaluation budget: they keep what to scale from.
        capped = self.depth <= 1
        before = self._snapshot() if sample < length or capped else None
        order = range(length - 1, -1, -1) if p.get("reverse") else range(length)
        for ran, i in enumerate(list(order)[:sample], 1):
            x_i = [x[:, i] if isinstance(x, np.ndarray) and x.ndim >= 2 else None for x in xs]
            outs = self.run(
                body.jaxpr, _bind_invars(body.jaxpr, consts + carry + x_i), weight, sure, False, body.consts
            )
            carry = outs[:n_carry]
            if capped and self.evaluated > _MAX_EVALUATED and ran < sample:
                sample = ran
                break
        if sample < length:
            self._scale_since(before, np.full(self.steps, length / sample))
            self.extrapolated = True
            return None
        return carry + [None] * (len(eqn.outvars) - n_carry)

    def _while_body(self, eqn, read, env, weight, sure):
        p = eqn.params
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        vals = [_pass(env, read, v) for v in eqn.invars]
        cconsts, bconsts, carry = vals[:nc], vals[nc : nc + nb], vals[nc + nb :]
        rec = self._loop_record(eqn, runtime=not static_fori(eqn))
        active = weight > 0
        trips = np.zeros(self.steps, np.float64)
        cost = max(1, len(bj.jaxpr.eqns))
        total = _fori_trips(cj, nc, carry)
        # A loop too long to evaluate whole but with its trip count known (a fori_loop to a known bound: emit_pipeline's
        # loop over its steps): evaluate a sample of its iterations and scale what they added to the whole count.
        sample = None
        capped = total is not None and self.depth <= 1  # as in _scan_body
        before_loop = self._snapshot() if capped else None
        if total is not None and total.max() * cost > self.budget // 2:
            sample = int(max(1, min(total.max(), max(_MIN_SAMPLE, self.budget // 2 // cost))))
            before = before_loop
        iterations = 0
        while True:
            (pred,) = self.run(cj.jaxpr, _bind_invars(cj.jaxpr, cconsts + carry), weight, sure, False, cj.consts)
            if not isinstance(pred, np.ndarray):
                break
            active = active & pred.reshape(self.steps).astype(bool)
            done = not active.any()
            if not done and capped and sample is None and self.evaluated > _MAX_EVALUATED and iterations:
                sample = iterations  # the kernel's evaluation budget spent: scaled from the iterations run
                before = before_loop
            if not done and sample is not None and iterations >= sample:
                self._scale_since(before, np.where(trips > 0, total / np.maximum(trips, 1), 1.0))
                self.extrapolated = True
                trips, done = np.where(weight > 0, total, 0.0), True
            if done:
                if rec.executions is not None:
                    rec.executions = rec.executions + weight * trips
                self._count_dma_loop(bj.jaxpr, weight * trips)
                return carry if sample is None or iterations < sample else None
            if sample is None and (self.budget < cost or (not capped and self.evaluated > 2 * _MAX_EVALUATED)):
                break
            self.budget -= cost  # a sampled loop evaluates its sample whatever is left
            iterations += 1
            trips += active
            outs = self.run(bj.jaxpr, _bind_invars(bj.jaxpr, bconsts + carry), weight * active, sure, False, bj.consts)
            carry = [
                np.where(active.reshape((self.steps,) + (1,) * (n.ndim - 1)), n, o)
                if isinstance(n, np.ndarray) and isinstance(o, np.ndarray) and n.shape == o.shape
                else None
                for n, o in zip(outs, carry)
            ]
        # Trips unknown (a condition on data the model cannot see, or too many to evaluate): the body once more,
        # with unknown carries, its DMAs counted once (a lower bound).
        self.dmas_lower = True
        self.run(bj.jaxpr, _bind_invars(bj.jaxpr, bconsts + [None] * len(carry)), weight, sure, False, bj.consts)
        rec.executions = None
        return None

    def _count_dma_loop(self, body, iterations):
        """A loop whose iterations start and wait on DMAs (a round trip each) runs pipeline steps; one that only starts
        or only waits is a batch's issue or drain, inside the step around it."""
        ops = _dma_ops(body)
        if ops == {"dma_start", "dma_wait"}:
            self.pipeline_steps += iterations
        elif ops:
            self.one_way_iterations += iterations

    def _snapshot(self):
        counters = {k: getattr(self, k).copy() for k in _COUNTERS}
        constructs = {id(c): (c, None if c.executions is None else c.executions.copy()) for c in self.constructs}
        return counters, constructs

    def _scale_since(self, before, factor):
        """Scale what was added since `before` by `factor` (per step): a sampled loop's share becomes the whole's."""
        counters, constructs = before
        for k in _COUNTERS:
            now = getattr(self, k)
            setattr(self, k, counters[k] + (now - counters[k]) * factor)
        for c in self.constructs:
            if c.executions is None:
                continue
            start = constructs.get(id(c), (c, np.zeros(self.steps)))[1]
            start = np.zeros(self.steps) if start is None else start
            c.executions = start + (c.executions - start) * factor


# The evaluator's per-step totals that a sampled loop scales.
_COUNTERS = ("flops", "dma_in", "dma_out", "dma_count", "dma_runs", "remote", "pipeline_steps", "one_way_iterations")


def _runs(ref) -> int:
    """Contiguous HBM runs of a DMA whose HBM side is `ref` (one when its slicing cannot be read)."""
    try:
        selection = dma_shape.ref_selection(ref)
        if selection is None:
            return 1
        shape, chosen = selection
        return dma_shape.hbm_runs(shape, chosen, np.dtype(ref.dtype).itemsize)
    except Exception:  # noqa: BLE001 - another jax's ref layout
        return 1


def _fori_trips(cond_jaxpr, n_consts, carry):
    """Iterations left of a fori_loop's while (its condition `i < upper` on the first two carries), per step; None if
    the loop is not of that form or the bounds are unknown."""
    jaxpr = cond_jaxpr.jaxpr
    if len(jaxpr.eqns) != 1 or jaxpr.eqns[0].primitive.name != "lt" or len(carry) < 2:
        return None
    lhs, rhs = jaxpr.eqns[0].invars
    if lhs is not jaxpr.invars[n_consts] or rhs is not jaxpr.invars[n_consts + 1]:
        return None
    i, upper = carry[0], carry[1]
    if not isinstance(i, np.ndarray) or not isinstance(upper, np.ndarray):
        return None
    return np.maximum(upper.reshape(-1).astype(np.float64) - i.reshape(-1), 0.0)


def _absolute_index(ref: KnownRef, idx):
    """Indices into a block (one per dimension the kernel sees) -> indices into the whole array, per step."""
    seen = iter(idx)
    out = []
    for d, (kind, size) in enumerate(ref.dims):
        start = ref.block_index[:, d].astype(np.int64)
        if kind == "squeezed":
            out.append(start)
            continue
        i = next(seen, None)
        if i is None:
            return None
        out.append(start * (size if kind == "blocked" else 1) + i)
    if next(seen, None) is not None:
        return None
    return out


def _vector_work(jaxpr, dots_only=False) -> bool:
    """Whether `jaxpr` computes on vectors (or, with dots_only, multiplies matrices) itself: in calls, not in nested
    loops or conditionals."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("scan", "while", "cond", "dma_start", "dma_wait"):
            continue
        if name == "dot_general":
            return True
        subs = sub_jaxprs(eqn)
        if subs:
            if any(_vector_work(j, dots_only) for j, _ in subs):
                return True
            continue
        if dots_only:
            continue
        for v in list(eqn.outvars) + (list(eqn.invars[1:2]) if name == "swap" else []):
            aval = getattr(v, "aval", None)
            shape = getattr(aval, "shape", ())
            if not hasattr(aval, "inner_aval") and math.prod(shape) > 1:
                return True
    return False


def _is_vector(v) -> bool:
    aval = getattr(v, "aval", None)
    return not hasattr(aval, "inner_aval") and math.prod(getattr(aval, "shape", ())) > 1


def _predicable(jaxpr) -> bool:
    """Whether `jaxpr` holds only scalar work and DMA starts/waits, in its conditionals and calls too (no vector value,
    no matmul, no loop): code the compiler can if-convert into predicated scalar and DMA instructions."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("scan", "while", "dot_general"):
            return False
        if name in ("dma_start", "dma_wait"):
            continue
        subs = list(all_sub_jaxprs(eqn))
        if subs:
            if not all(_predicable(j) for j in subs):
                return False
            continue
        if any(_is_vector(v) for v in list(eqn.outvars) + (list(eqn.invars[1:2]) if name == "swap" else [])):
            return False
    return True


def _has_cond(jaxpr) -> bool:
    return any(e.primitive.name == "cond" or any(_has_cond(j) for j, _ in sub_jaxprs(e)) for e in jaxpr.eqns)


def _has_dot(jaxpr) -> bool:
    return any(e.primitive.name == "dot_general" or any(_has_dot(j) for j in all_sub_jaxprs(e)) for e in jaxpr.eqns)


def _has_loop(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("scan", "while") or any(_has_loop(j) for j in all_sub_jaxprs(eqn)):
            return True
    return False


def _dma_ops(jaxpr) -> set:
    """Which of dma_start / dma_wait `jaxpr` holds itself (in its conditionals and calls, not in nested loops)."""
    ops = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dma_start", "dma_wait"):
            ops.add(eqn.primitive.name)
        elif eqn.primitive.name not in ("scan", "while"):
            for j in all_sub_jaxprs(eqn):
                ops |= _dma_ops(j)
    return ops


def all_sub_jaxprs(eqn):
    """Every jaxpr an eqn holds (call bodies, cond branches, loop bodies, run_scoped regions)."""
    for v in eqn.params.values():
        for j in v if isinstance(v, (tuple, list)) else (v,):
            j = getattr(j, "jaxpr", j)
            if hasattr(j, "eqns"):
                yield j


def _pass(env, read, v):
    """A value to hand to a sub-jaxpr: known refs stay refs."""
    x = env.get(v) if not is_literal(v) else None
    return x if isinstance(x, KnownRef) else read(v)


def _bind_invars(jaxpr, vals):
    return dict(zip(jaxpr.invars, list(vals) + [None] * (len(jaxpr.invars) - len(vals))))


# Where call-like primitives keep the jaxpr they call with the eqn's own operands: jit/pjit `jaxpr`, custom_vjp
# `call_jaxpr`, custom_jvp `fun_jaxpr`, custom_vmap `call` (tokamax wraps its pallas_calls in one).
CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr", "call")


def sub_jaxprs(eqn):
    """(jaxpr, consts) of each jaxpr a call-like eqn calls with its own operands."""
    out = []
    for k in CALL_PARAMS:
        j = eqn.params.get(k)
        if j is None:
            continue
        if hasattr(j, "jaxpr") and hasattr(j, "consts"):
            out.append((j.jaxpr, list(j.consts)))
        elif hasattr(j, "eqns"):
            out.append((j, []))
    return out


def _dot_flops(eqn) -> int:
    try:
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        out = eqn.outvars[0].aval.shape
        return 2 * math.prod(out) * math.prod(lhs[i] for i in lc)
    except Exception:  # noqa: BLE001
        return 0


def static_fori(eqn) -> bool:
    """A fori_loop's while with literal bounds: the carry starts (i, upper, ...) from literals; Mosaic makes it a
    counted loop, whose trip count is in the schedule."""
    n_consts = eqn.params.get("cond_nconsts", 0) + eqn.params.get("body_nconsts", 0)
    carry = eqn.invars[n_consts:]
    return len(carry) >= 2 and all(is_literal(v) for v in carry[:2])


def evaluate_kernel(kjaxpr, grid, pids, steps, known_refs: dict[int, Any] | None = None) -> KernelEval:
    """Evaluate kernel jaxpr `kjaxpr` at every grid step. pids: program ids per grid axis (arrays of `steps`);
    known_refs: {kernel operand index: KnownRef}."""
    warnings: list[str] = []
    ev = _Evaluator(tuple(grid), list(pids), steps, warnings)
    env = {kjaxpr.invars[i]: r for i, r in (known_refs or {}).items()}
    ev.run(kjaxpr, env, np.ones(steps, np.float64), np.ones(steps, bool), True)
    return KernelEval(
        conds=ev.conds,
        cond_regions=ev.cond_regions,
        dot_flops=ev.flops,
        dma_in=ev.dma_in,
        dma_out=ev.dma_out,
        dma_count=ev.dma_count,
        dma_runs=ev.dma_runs,
        remote_bytes=ev.remote,
        constructs=ev.constructs,
        pipeline_steps=ev.pipeline_steps,
        one_way_iterations=ev.one_way_iterations,
        dmas_upper=ev.dmas_upper,
        dmas_lower=ev.dmas_lower,
        extrapolated=ev.extrapolated,
        warnings=sorted(set(warnings)),
    )
