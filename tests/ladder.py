"""The verification ladder as helpers shared by every kernel's tests.

Rung 1  run_kernel / check_against_reference: the kernel in Pallas' TPU interpret mode with race detection,
        out-of-bounds reads raising and uninitialized memory reading as NaN, against a plain-jnp reference on fresh
        random inputs. Output buffers start as NaN in that mode (uninitialized_memory="nan"), so any element a kernel
        fails to write shows up as NaN, and NaN never passes assert_close.
        On the chip (the on-chip tier, environment.ON_CHIP) the same helpers compile the kernel with Mosaic and run it
        on the TPU against the same references and tolerances; the check helpers then repeat each comparison on
        inputs drawn afresh (redrawn), so that an output element left unwritten, holding a stale value, fails there too.
Rung 2  export_for_tpu: jax.export for the TPU platform, what TorchTPU's jax_op does at call time.
Rung 3  compile_for_tpu: deviceless compile for v5e / v6e / v7x through libtpu: Mosaic lowering, layouts, VMEM fit.
Torch   check_torch_op: torch.library.opcheck, FakeTensorMode and meta shapes, torch.compile(fullgraph=True).
Shared  check_gradients (kernel vs reference gradients with fixed random cotangents), BadInput + bad_input_params +
        assert_clear_error (tables of bad inputs and the error each must raise), pallas_calls (the kernels a traced
        program launches, with their grids, scratch and VMEM limits: which tiling and path a `blocks=` reached).

A test of a kernel test module that calls a rung-1 helper runs on the chip too; one that compiles for a deviceless TPU
(rungs 2 and 3, tpu_device) or only inspects traced programs, tuning tables or argument checks is marked
`@pytest.mark.cpu_only`, which the on-chip tier deselects. The helpers check the marker against what they are called
for (CURRENT_TEST), in `make test` as on the chip.
"""

import contextlib
import functools
import os
import secrets
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from environment import ON_CHIP
from jax.experimental import topologies
from jax.experimental.pallas import tpu as pltpu

from tpu_kernels_jax.common import chip
from tpu_kernels_jax.common.interpret import STRICT_INTERPRET_PARAMS, interpreter_in_shard_map

try:  # where jax keeps the race detector's verdict (jax 0.10 - 0.12)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _interpret_state
except ImportError:  # pragma: no cover - older layout
    from jax._src.pallas.mosaic import interpret as _interpret_state

# Topologies with one device per chip for each generation the project targets (rung 3).
TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:1x1", "v7x": "tpu7x:2x2x1"}
GENERATIONS = tuple(TOPOLOGIES)

# (rtol, atol) for comparing a kernel to its f32 reference, by the kernel's input dtype.
TOLERANCES = {
    jnp.dtype(jnp.float32): (1e-5, 1e-5),
    jnp.dtype(jnp.bfloat16): (1.6e-2, 1.6e-2),
    jnp.dtype(jnp.float16): (2e-3, 2e-3),
}


# ---------------------------------------------------------------------------------------------------------- inputs
class RandomInputs:
    """Fresh random data for every check; the seed is drawn per test and shown in every failure message.
    To replay a failure: TPU_KERNELS_TEST_SEED=<seed> pytest <that test>."""

    def __init__(self, seed: int | None = None):
        replay = os.environ.get("TPU_KERNELS_TEST_SEED")
        if seed is None and replay:
            seed = int(replay)
        self.seed = secrets.randbits(32) if seed is None else seed
        self.rng = np.random.default_rng(self.seed)
        self.drawn = {}  # what draw() picked, by name: shown with the seed

    def draw(self, name: str, options):
        """One of `options` (a sequence or a range), picked at random and recorded under `name`."""
        value = options[int(self.rng.integers(len(options)))]
        self.drawn[name] = value
        return value

    def normal(self, shape, dtype=jnp.float32, scale=1.0, offset=0.0):
        values = self.rng.standard_normal(shape, dtype=np.float32) * scale + offset
        return jnp.asarray(values, dtype=dtype)

    def uniform(self, shape, low, high, dtype=jnp.float32):
        return jnp.asarray(self.rng.uniform(low, high, shape).astype(np.float32), dtype=dtype)

    def integers(self, low, high, shape, dtype=jnp.int32):
        return jnp.asarray(self.rng.integers(low, high, shape), dtype=dtype)

    def cotangents(self, fn, *args):
        """Random f32 cotangents shaped like fn(*args)'s outputs (a pytree; None leaves stay None)."""
        shapes = jax.eval_shape(fn, *args)
        return jax.tree_util.tree_map(lambda s: self.normal(s.shape), shapes)

    def __repr__(self):
        drawn = ", ".join(f"{name}={_shown(value)}" for name, value in self.drawn.items())
        return f"RandomInputs(seed={self.seed}{'; drew ' + drawn if drawn else ''})"


def _shown(value):
    """A drawn value as a failure message shows it: a dtype by its name."""
    return jnp.dtype(value).name if isinstance(value, (type, np.dtype)) else repr(value)


@pytest.fixture
def rand():
    return RandomInputs()


# The seeded random-shape sweep: each kernel module's test_random_draw, parametrized by random_draws, draws its sizes,
# layouts and features with rand.draw and checks the kernel against its reference (rung 1). Draws per family:
# TPU_KERNELS_SWEEP_DRAWS; by default one on the CPU host (the feature tests hold the coverage; every run draws anew)
# and eight on the chip, where a draw costs its compiles.
SWEEP_DRAWS = int(os.environ.get("TPU_KERNELS_SWEEP_DRAWS") or (8 if ON_CHIP else 1))
random_draws = pytest.mark.parametrize("draw", range(SWEEP_DRAWS))


# experts_forward's two paths, forced through blocks= (the JAX tests pass moe_blocks(path, ...) themselves).
MOE_PATHS = ("grouped", "small_batch")
# The kernel that marks each path in a traced program (and that the other path never runs).
MOE_PATH_KERNELS = {"small_batch": "moe_experts_small_batch", "grouped": "ragged_dot_fwd"}


def moe_blocks(
    path,
    gate_up_proj,
    down_proj,
    gate_up_bias=None,
    *,
    gate_layout="concatenated",
    weights_transposed=False,
    fallback=False,
):
    """blocks= forcing `path` for these weights: the grouped matmuls at any batch, or the small-batch kernel at any
    batch with its smallest legal intermediate chunk (several grid steps per expert). With `fallback`, weights the
    small-batch kernel cannot serve (more experts than its touched-expert list takes, no legal chunk) get the
    grouped path instead."""
    from tpu_kernels_jax.api import ExpertsBlocks
    from tpu_kernels_jax.moe import tuning

    grouped = ExpertsBlocks(path="grouped")
    if path == "grouped":
        return grouped
    if tuning.small_batch_unsupported(num_experts=gate_up_proj.shape[0], gate_layout=gate_layout):
        assert fallback, "the small-batch kernel cannot serve these inputs"
        return grouped
    chunks = tuning.small_batch_chunks(
        down_proj.shape[1 if weights_transposed else 2],
        gate_up_shape=tuple(gate_up_proj.shape),
        down_shape=tuple(down_proj.shape),
        weights_transposed=weights_transposed,
        gate_layout=gate_layout,
        has_gate_up_bias=gate_up_bias is not None,
        weight_dtype=gate_up_proj.dtype,
        down_dtype=down_proj.dtype,
    )
    if not chunks:
        assert fallback, "the small-batch kernel has no legal chunk for these weights"
        return grouped
    return ExpertsBlocks(path="small_batch", chunk=chunks[-1])


def assert_moe_path(fn, args, path):
    """The program fn(*args) traces to holds the kernels of `path` and not the other's."""
    text = str(jax.make_jaxpr(fn)(*args))
    other = next(p for p in MOE_PATHS if p != path)
    want, avoid = MOE_PATH_KERNELS[path], MOE_PATH_KERNELS[other]
    assert want in text and avoid not in text, f"expected the {path} path ({want}, no {avoid})"


class MoePath:
    """One of experts_forward's paths for the torch tests: `blocks(experts, tokens, top_k)` is the blocks= that
    forces it for an experts module's weights (moe_blocks with fallback: transformers' layouts the small-batch kernel
    cannot serve take the grouped path), asserted first to trace to that path's kernels in the op's own JAX function
    (the JSON the op receives included) at [tokens, H] with top_k slots."""

    def __init__(self, path):
        self.path = path
        self.asked = 0

    def blocks(self, experts, tokens, top_k):
        from tpu_kernels import moe_ops

        has_gate = getattr(experts, "has_gate", True)
        gate_up = experts.gate_up_proj if has_gate else experts.up_proj
        bias = (
            (experts.gate_up_proj_bias if has_gate else experts.up_proj_bias)
            if getattr(experts, "has_bias", False)
            else None
        )
        down_bias = experts.down_proj_bias if getattr(experts, "has_bias", False) else None
        gate_layout = (
            ("concatenated" if getattr(experts, "is_concatenated", True) else "interleaved") if has_gate else None
        )
        transposed = bool(getattr(experts, "is_transposed", False))

        def spec(t):
            return None if t is None else jax.ShapeDtypeStruct(tuple(t.shape), str(t.dtype).removeprefix("torch."))

        weights = [spec(t) for t in (gate_up, experts.down_proj, bias, down_bias)]
        blocks = moe_blocks(
            self.path,
            *weights[:3],
            gate_layout=gate_layout,
            weights_transposed=transposed,
            fallback=True,
        )
        hidden, dtype = weights[0].shape[1 if transposed else 2], weights[0].dtype
        routing = [jax.ShapeDtypeStruct((tokens, top_k), t) for t in (jnp.int32, dtype)]
        specs = [jax.ShapeDtypeStruct((tokens, hidden), dtype), *routing, *weights]
        fn = functools.partial(
            moe_ops.experts_forward_op.jax_fn,
            activation=moe_ops.gating(experts, has_gate),
            gate_layout=gate_layout or "none",
            weights_transposed=transposed,
            gate_up_scale=None,
            down_scale=None,
            blocks=moe_ops.experts_blocks_json(blocks),
        )
        assert_moe_path(fn, specs, blocks.path)
        self.asked += 1
        return blocks


@pytest.fixture(params=MOE_PATHS)
def moe_path(request):
    """The path the test forces, as a MoePath: its experts_forward calls pass blocks=moe_path.blocks(...); a test
    that never asks for them fails."""
    forced = MoePath(request.param)
    yield forced
    assert forced.asked, "the test never asked moe_path for blocks: no path was forced"


# ---------------------------------------------------------------------------------------------------------- rung 1
# The running test when its module belongs to the on-chip tier (conftest sets it), for the marker checks below.
CURRENT_TEST = None


def _runs_a_kernel(helper: str):
    """A rung-1 helper was called: the test belongs to the on-chip tier, so it must not be marked cpu_only."""
    if CURRENT_TEST is not None and CURRENT_TEST.get_closest_marker("cpu_only"):
        pytest.fail(
            f"{CURRENT_TEST.nodeid} is marked cpu_only but runs a kernel against its reference ({helper}): the "
            "on-chip tier must run it; drop the marker, or split off the part that needs the CPU host",
            pytrace=False,
        )


def _needs_the_cpu_host(helper: str):
    """A deviceless TPU (rungs 2 and 3) was asked for: the on-chip tier cannot run the test, which must say so."""
    if CURRENT_TEST is not None and not CURRENT_TEST.get_closest_marker("cpu_only"):
        pytest.fail(
            f"{CURRENT_TEST.nodeid} uses a deviceless TPU ({helper}), which the on-chip tier does not have: mark it "
            "@pytest.mark.cpu_only, or split off the part that runs a kernel against its reference",
            pytrace=False,
        )


def chip_generation() -> str:
    """The generation the kernels are traced for: the chip's on the on-chip tier; on the CPU host the one
    TPU_KERNELS_TARGET names (v6e by default)."""
    return chip.generation_name(chip.current_tpu_info())


def traced_generations(generations) -> list[str]:
    """The generations a test traces its kernels for through TPU_KERNELS_TARGET: each of them on the CPU host; on the
    chip only its own (the variable does not apply where a TPU is the default device)."""
    return [chip_generation()] if ON_CHIP else list(generations)


def races_found() -> bool:
    state = getattr(_interpret_state, "races", None)
    return bool(state is not None and state.races_found)


def run_kernel(fn, *args, params: pltpu.InterpretParams = STRICT_INTERPRET_PARAMS, **kwargs):
    """fn(*args, **kwargs), ready, for a rung-1 check. On the CPU host under strict TPU interpret mode (`params`),
    failing on a data race; on the chip as the caller wrote it (jitted or eager): Mosaic compiles the kernels and
    nothing is forced. Returns fn's outputs."""
    _runs_a_kernel("run_kernel")
    if ON_CHIP:
        return jax.block_until_ready(fn(*args, **kwargs))
    pltpu.reset_tpu_interpret_mode_state()
    try:
        with pltpu.force_tpu_interpret_mode(params), interpreter_in_shard_map():
            out = jax.block_until_ready(fn(*args, **kwargs))
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()  # the simulator keeps its state after an exception
        raise
    assert not races_found(), f"the race detector found a data race in {getattr(fn, '__name__', fn)}"
    return out


def redrawn(args, rng: np.random.Generator):
    """args with every floating array wider than 8 bits drawn afresh with its own mean and standard deviation,
    clipped to its own range (a positive scale stays positive); non-finite elements (NaN poison, +-inf) and every
    other leaf (integer metadata, 8-bit weights, Python numbers) kept. Converted on the host: no compile."""

    def redraw(leaf):
        dtype = getattr(leaf, "dtype", None)
        if not isinstance(leaf, (jax.Array, np.ndarray)) or not jnp.issubdtype(dtype, jnp.floating):
            return leaf
        if jnp.dtype(dtype).itemsize < 2:
            return leaf
        values = _as_f32_numpy(leaf)
        finite = np.isfinite(values)
        if not finite.any():
            return leaf
        kept = values[finite]
        fresh = np.clip(rng.normal(kept.mean(), kept.std(), values.shape), kept.min(), kept.max())
        return jnp.asarray(np.where(finite, fresh, values).astype(np.float32).astype(dtype))

    return jax.tree_util.tree_map(redraw, args)


def _on_every_draw(compare, args, rand):
    """compare(args), returning its result; on the chip once more on redrawn(args). Outputs on the chip are not
    NaN-poisoned: an element the kernel leaves unwritten holds what the buffer held before, maybe the right value
    of an earlier run; on inputs drawn afresh it is wrong. The second run reuses the compiled programs."""
    result = compare(args)
    if ON_CHIP:
        compare(redrawn(args, rand.rng if rand is not None else np.random.default_rng(0)), " (inputs redrawn)")
    return result


def _as_f32_numpy(a):
    """a as a float32 numpy array, widened on the host (exact for every dtype the kernels take): no XLA compile of a
    convert per shape."""
    return np.asarray(a).astype(np.float32)


def assert_close(actual, expected, *, dtype=None, rtol=None, atol=None, what="output", context=""):
    """Elementwise |actual - expected| <= atol + rtol * |expected|, NaN anywhere in actual fails."""
    dtype = jnp.dtype(dtype if dtype is not None else jnp.asarray(expected).dtype)
    default_rtol, default_atol = TOLERANCES.get(dtype, TOLERANCES[jnp.dtype(jnp.float32)])
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    actual_np, expected_np = _as_f32_numpy(actual), _as_f32_numpy(expected)
    assert actual_np.shape == expected_np.shape, f"{what}: shape {actual_np.shape} != {expected_np.shape} {context}"
    assert not np.isnan(actual_np).any(), (
        f"{what}: {int(np.isnan(actual_np).sum())} NaN element(s) (unwritten or poisoned) {context}"
    )
    np.testing.assert_allclose(actual_np, expected_np, rtol=rtol, atol=atol, err_msg=f"{what} {context}")


def relative_to_largest(atol: float, fraction: float):
    """A tolerance for assert_close's atol through the check helpers: `atol` plus `fraction` of the expected array's
    largest magnitude. For results whose rounding scales with their largest terms rather than with each element (long
    f32 sums with cancellation, a bf16 intermediate rounded once and summed again)."""
    return lambda expected: atol + fraction * float(np.max(np.abs(_as_f32_numpy(expected)), initial=0.0))


# On the chip, float32 gradient bounds are this many times wider. Mosaic's float32 matmuls there are multi-pass
# bfloat16 (about 1e-5 relative a product) and a gradient sums hundreds of rows' products: the first clean on-chip run
# put 1 to 12 elements in 1e5 of four float32 attention gradients (dk / dv) at 1.4-1.7e-4 from the reference, against
# a 1e-4 bound; the forward's float32 checks hold their interpret-mode bounds.
CHIP_F32_GRADIENT_SLACK = 3.0


def _resolved(tolerance: dict, expected) -> dict:
    """{"atol": ..., "rtol": ...} with each value given as a number, None (the dtype's), or a function of the
    expected array (a bound relative to the size of the summed terms), evaluated."""
    return {key: value(expected) if callable(value) else value for key, value in tolerance.items()}


# What stops a reference from being jitted: it reads values on the host (a loop over concrete sequence lengths).
_NEEDS_CONCRETE_VALUES = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)


def run_reference(reference_fn, *args):
    """reference_fn(*args), jitted: one XLA compile for the whole reference instead of one per jnp op, which is what
    an eager reference costs on each new shape (most of a reference check's time). Non-array arguments are static.
    A reference that needs concrete values runs eagerly. On the chip its matmuls run at full float32 precision: XLA's
    default there is one bfloat16 pass for float32 operands, about 1e-3 off, which no float32 tolerance would take
    (the first chip run's float32 attention checks failed by 3e-3 against a 1e-5 bound); on a CPU they are float32
    already."""
    static = tuple(i for i, a in enumerate(args) if isinstance(a, (bool, int, float, str, tuple)))
    with jax.default_matmul_precision("highest") if ON_CHIP else contextlib.nullcontext():
        try:
            return jax.jit(reference_fn, static_argnums=static)(*args)
        except _NEEDS_CONCRETE_VALUES:
            return reference_fn(*args)


def check_against_reference(
    kernel_fn, reference_fn, args, *, dtype, rand=None, rtol=None, atol=None, names=None, jit_kernel=False
):
    """Rung 1: kernel (run_kernel) vs reference on the same inputs; compares every output leaf (on the chip on redrawn
    inputs too) and returns the kernel's outputs on `args`. `atol` / `rtol` may be a function of the expected output
    (a bound relative to the size of the summed terms).
    jit_kernel: the kernel call runs as one jitted program, one XLA:CPU compile instead of one per op around the
    kernel (its argument checks then see tracers: only for valid inputs whose call does not branch on their values)."""
    kernel = jax.jit(kernel_fn) if jit_kernel else kernel_fn

    def compare(inputs, drawn=""):
        actual = run_kernel(kernel, *inputs)
        expected = run_reference(reference_fn, *inputs)
        actual_leaves = jax.tree_util.tree_leaves(actual)
        expected_leaves = jax.tree_util.tree_leaves(expected)
        assert len(actual_leaves) == len(expected_leaves), "kernel and reference return different structures"
        for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
            what = (names[i] if names else f"output {i}") + drawn
            assert jnp.asarray(a).dtype == jnp.asarray(e).dtype, f"{what}: dtype {a.dtype} != reference {e.dtype}"
            tolerance = _resolved(dict(atol=atol, rtol=rtol), e)
            assert_close(a, e, dtype=dtype, what=what, context=repr(rand) if rand else "", **tolerance)
        return actual

    return _on_every_draw(compare, args, rand)


def vjp_loss(outs, cotangents=None):
    """<outs, cotangents>: the scalar whose gradient is the vjp of `outs` with fixed cotangents, the same for kernel
    and reference. A loss whose cotangent depends on the output (sum(sin(out))) turns a one-ulp bf16 difference
    between the two outputs into a different cotangent and so a gradient gap (0.14 in RMSNorm, 0.056 in RoPE).
    Without cotangents, a plain sum: for export and compile checks, where no values are compared."""
    leaves = jax.tree_util.tree_leaves(outs)
    if cotangents is None:
        return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in leaves)
    cotangent_leaves = jax.tree_util.tree_leaves(cotangents)
    assert len(leaves) == len(cotangent_leaves), "one cotangent per output"
    return sum(jnp.sum(leaf.astype(jnp.float32) * c) for leaf, c in zip(leaves, cotangent_leaves))


def _fixed_cotangent_gradients(fn, cotangents, argnums):
    """a -> (fn(*a), gradients of <fn(*a), cotangents> w.r.t. a[argnums])."""
    grad = jax.grad(lambda *a: vjp_loss(fn(*a), cotangents), argnums=argnums)
    return lambda *a: (fn(*a), grad(*a))


def check_forward_and_gradients(
    kernel, reference, args, *, argnums, names, rand, dtype, out_tolerance, grad_tolerance, return_gradients=False
):
    """The output and its gradients w.r.t. args[argnums] under one fixed random cotangent (vjp_loss), kernel
    (run_kernel) against reference: forward and backward in one program each (one compile instead of two), on the
    chip on redrawn inputs too. The tolerances' values may be functions of the expected array (as check_gradients').
    Returns the kernel's output on `args` (and its gradients, with return_gradients)."""
    cotangents = rand.cotangents(reference, *args)
    kernel_program = jax.jit(_fixed_cotangent_gradients(kernel, cotangents, argnums))
    reference_program = _fixed_cotangent_gradients(reference, cotangents, argnums)

    def compare(inputs, drawn=""):
        out, grads = run_kernel(kernel_program, *inputs)
        expected_out, expected_grads = run_reference(reference_program, *inputs)
        assert out.dtype == expected_out.dtype, f"output: dtype {out.dtype} != reference {expected_out.dtype}"
        tolerance = _resolved(out_tolerance, expected_out)
        assert_close(out, expected_out, dtype=dtype, what="output" + drawn, context=repr(rand), **tolerance)
        for name, actual, expected in zip(names, grads, expected_grads, strict=True):
            assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != reference {expected.dtype}"
            tolerance = _resolved(grad_tolerance, expected)
            assert_close(actual, expected, dtype=dtype, what=name + drawn, context=repr(rand), **tolerance)
        return out, grads

    out, grads = _on_every_draw(compare, args, rand)
    return (out, grads) if return_gradients else out


def differentiated(args, names: dict) -> tuple[tuple, list]:
    """(argnums, names) for the gradient checks: the positions of `names` ({argument position: gradient name}) whose
    argument is given (not None)."""
    given = {i: name for i, name in names.items() if args[i] is not None}
    return tuple(given), list(given.values())


def check_gradients(kernel_fn, reference_fn, args, *, argnums, rand, dtype, names=None, atol=None, rtol=None):
    """Gradients of kernel_fn and reference_fn w.r.t. args[argnums] under one fixed random cotangent (vjp_loss).

    The kernel's gradient runs jitted through run_kernel (rung 1), the reference's through run_reference; on the chip
    on redrawn inputs too. `atol` / `rtol` may be a number or a dict keyed by gradient name (sums over many rows
    carry bf16 rounding further); a value may also be a function of the expected gradient (a bound relative to the
    size of the summed terms). Returns the kernel's gradients on `args`.
    """
    argnums = tuple(argnums)
    cotangents = rand.cotangents(reference_fn, *args)

    def loss_of(fn):
        return jax.grad(lambda *a: vjp_loss(fn(*a), cotangents), argnums=argnums)

    kernel_grad, reference_grad = jax.jit(loss_of(kernel_fn)), loss_of(reference_fn)
    names = names or [f"d arg {i}" for i in argnums]
    assert len(names) == len(argnums), "one name per differentiated argument"

    def compare(inputs, drawn=""):
        actual = run_kernel(kernel_grad, *inputs)
        expected = run_reference(reference_grad, *inputs)
        for name, a, e in zip(names, actual, expected):
            assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} != reference {e.dtype}"
            tol_a = atol.get(name) if isinstance(atol, dict) else atol
            tol_r = rtol.get(name) if isinstance(rtol, dict) else rtol
            tolerance = _resolved(dict(atol=tol_a, rtol=tol_r), e)
            if ON_CHIP and jnp.dtype(dtype) == jnp.float32:
                tolerance = {k: None if v is None else v * CHIP_F32_GRADIENT_SLACK for k, v in tolerance.items()}
            assert_close(a, e, dtype=dtype, what=name + drawn, context=repr(rand), **tolerance)
        return actual

    return _on_every_draw(compare, args, rand)


class KernelCall(NamedTuple):
    """One pallas_call of a traced program: what a tiling reaches, read from the jaxpr (no kernel runs)."""

    name: str
    grid: tuple
    scratch_operands: int
    vmem_limit_bytes: int | None


def _sub_jaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def pallas_calls(fn, *args) -> list[KernelCall]:
    """The Pallas kernels fn(*args) launches (forward and, for a jax.grad, backward), in trace order: their names,
    grids, scratch operand counts and VMEM limits. args may be ShapeDtypeStructs."""
    calls = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                grid_mapping = eqn.params["grid_mapping"]
                compiler_params = eqn.params.get("compiler_params")
                calls.append(
                    KernelCall(
                        name=str(eqn.params.get("name")),
                        grid=tuple(grid_mapping.grid),
                        scratch_operands=grid_mapping.num_scratch_operands,
                        vmem_limit_bytes=getattr(compiler_params, "vmem_limit_bytes", None),
                    )
                )
            for value in eqn.params.values():
                for sub in _sub_jaxprs(value):
                    walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return calls


class BadInput(NamedTuple):
    """One row of a bad-input table: what to change in the good arguments and the error that must follow."""

    id: str
    change: Callable[[Any], dict] | dict  # rand -> {argument: bad value}, or the dict itself
    error: type[Exception]
    message: str  # a substring of the message: the argument's name and what was expected or given


def bad_input_params(cases: list[BadInput]):
    """pytest.mark.parametrize("case", ...) over a bad-input table, one test id per row."""
    return pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])


def assert_clear_error(case: BadInput, call: Callable[[dict], Any], good: dict, rand):
    """Apply `case` to a copy of `good`, call `call(arguments)` and check the error type and message."""
    changes = case.change(rand) if callable(case.change) else dict(case.change)
    arguments = {**good, **changes}
    with pytest.raises(case.error) as info:
        call(arguments)
    assert case.message in str(info.value), f"{case.id}: expected {case.message!r} in {str(info.value)!r}"
    return info.value


# ---------------------------------------------------------------------------------------------------------- rung 2
def export_for_tpu(fn, *specs, **static_kwargs):
    """Rung 2: export for the TPU platform on this CPU host; asserts the module holds a Mosaic kernel."""
    _needs_the_cpu_host("export_for_tpu")
    exported = jax.export.export(jax.jit(functools.partial(fn, **static_kwargs)), platforms=["tpu"])(*specs)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text, "the TPU export holds no Mosaic kernel (tpu_custom_call)"
    return exported


# ---------------------------------------------------------------------------------------------------------- rung 3
def tpu_device(generation: str):
    """A compile-only device of the given generation (no TPU needed)."""
    _needs_the_cpu_host("tpu_device")
    return _topology_device(generation)


@functools.cache
def _topology_device(generation: str):
    return topologies.get_topology_desc(TOPOLOGIES[generation], "tpu").devices[0]


def tpu_spec(generation: str, shape, dtype):
    sharding = jax.sharding.SingleDeviceSharding(tpu_device(generation))
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


COMPILE_STATS: list[dict] = []  # written to build/compile_stats-jax<version>.json at session end (conftest)


def compile_for_tpu(fn, generation: str, *shapes_and_dtypes, label: str = "", min_kernels: int = 1, **static_kwargs):
    """Rung 3: deviceless compile of jit(fn) for `generation`; returns the memory stats it records.

    shapes_and_dtypes: (shape, dtype) pairs, or None for an absent optional argument. Tracing happens with the
    generation's device as default device, so the kernels' tuning sees that chip. The Mosaic kernels are counted in
    the lowered module (`compiled.as_text()` of some programs with sorts and scatters fails in XLA on v6e/v7x
    although the compile itself succeeded).
    """
    _needs_the_cpu_host("compile_for_tpu")
    specs = [None if sd is None else tpu_spec(generation, *sd) for sd in shapes_and_dtypes]
    with jax.default_device(tpu_device(generation)):
        lowered = jax.jit(functools.partial(fn, **static_kwargs)).lower(*specs)
        compiled = lowered.compile()
    kernels = lowered.as_text().count("tpu_custom_call")
    assert kernels >= min_kernels, f"{label}: the program holds {kernels} Mosaic kernel(s), expected >= {min_kernels}"
    memory = compiled.memory_analysis()
    stats = {
        "label": label or getattr(fn, "__name__", str(fn)),
        "generation": generation,
        "inputs": [None if sd is None else [list(sd[0]), str(jnp.dtype(sd[1]))] for sd in shapes_and_dtypes],
        "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "output_bytes": getattr(memory, "output_size_in_bytes", None),
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
    }
    COMPILE_STATS.append(stats)
    return stats


def tpu_mesh(topology: str, axis_names: tuple):
    """A one-axis mesh over every chip of a compile-only TPU topology (e.g. "v6e:2x4"): sharded programs for rung 3."""
    _needs_the_cpu_host("tpu_mesh")
    return _topology_mesh(topology, axis_names)


@functools.cache
def _topology_mesh(topology: str, axis_names: tuple):
    devices = topologies.get_topology_desc(topology, "tpu").devices
    return jax.sharding.Mesh(np.array(devices), axis_names)


def compile_sharded_for_tpu(fn, mesh, shapes_dtypes_specs, *, label: str, min_kernels: int = 1):
    """Rung 3 for a program over a whole slice: deviceless compile of jit(fn) with each input (shape, dtype,
    PartitionSpec) sharded over `mesh` (tpu_mesh); records the memory stats (per device) as compile_for_tpu does."""
    _needs_the_cpu_host("compile_sharded_for_tpu")
    specs = [
        jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=jax.sharding.NamedSharding(mesh, spec))
        for shape, dtype, spec in shapes_dtypes_specs
    ]
    lowered = jax.jit(fn).lower(*specs)
    compiled = lowered.compile()
    kernels = lowered.as_text().count("tpu_custom_call")
    assert kernels >= min_kernels, f"{label}: the program holds {kernels} Mosaic kernel(s), expected >= {min_kernels}"
    memory = compiled.memory_analysis()
    stats = {
        "label": label,
        "generation": str(mesh.devices.flat[0].device_kind),
        "devices": int(mesh.devices.size),
        "inputs": [[list(shape), str(jnp.dtype(dtype)), str(spec)] for shape, dtype, spec in shapes_dtypes_specs],
        "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "output_bytes": getattr(memory, "output_size_in_bytes", None),
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
    }
    COMPILE_STATS.append(stats)
    return stats


# ---------------------------------------------------------------------------------------------------------- torch
def check_torch_op(op, args, *, expected_shapes):
    """opcheck (schema, fake, autograd registration, AOT dispatch incl. dynamic shapes), FakeTensorMode and meta
    shapes, and torch.compile(fullgraph=True) tracing through the op with the eager result."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.library.opcheck(op, args)

    def shapes(result):
        leaves = result if isinstance(result, (tuple, list)) else (result,)
        return [tuple(t.shape) for t in leaves]

    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        assert shapes(op(*fake_args)) == expected_shapes
    meta_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    assert shapes(op(*meta_args)) == expected_shapes

    eager = op(*args)
    # Every call compiles the same code object (the lambda below): start from a clean dynamo cache so a long session
    # of op checks does not hit dynamo's recompile limit.
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True, backend="aot_eager")(*args)
    eager_leaves = eager if isinstance(eager, (tuple, list)) else (eager,)
    compiled_leaves = compiled if isinstance(compiled, (tuple, list)) else (compiled,)
    for e, c in zip(eager_leaves, compiled_leaves):
        torch.testing.assert_close(c, e, rtol=0, atol=0)


# Torch-side gradient and compile checks. torch is imported inside them: the JAX-only environment imports this module
# without torch.
def _torch_leaves(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _outputs_and_grads(fn, inputs: dict, cotangents):
    """fn(**copies of inputs); with cotangents, also the gradients of the inputs that require grad."""
    import torch

    copies = {
        k: v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
        for k, v in inputs.items()
    }
    wanted = [k for k, v in copies.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    outputs = _torch_leaves(fn(**copies))
    if cotangents is None:
        return outputs, wanted, []
    loss = sum((out.float() * c).sum() for out, c in zip(outputs, cotangents) if out is not None)
    return outputs, wanted, list(torch.autograd.grad(loss, [copies[k] for k in wanted]))


def torch_cotangents(fn, inputs: dict, rand):
    """Fixed random f32 cotangents shaped like fn(**inputs)'s outputs (None for a None output)."""
    import torch

    with torch.no_grad():
        outputs = _torch_leaves(fn(**inputs))
    return [
        None if out is None else torch.from_numpy(rand.rng.standard_normal(tuple(out.shape), dtype="float32"))
        for out in outputs
    ]


def check_torch_gradients(fn, reference_fn, inputs: dict, *, rand, rtol, atol, overrides=None):
    """Torch-side rung 1 for an op with autograd: the outputs and the gradients of every input that requires grad,
    fn against reference_fn (torch's own autograd of the formula), under one fixed random cotangent per output (as
    check_gradients on the JAX side). overrides: {"out <i>" or "d <input>": (rtol, atol)}. Returns fn's gradients."""
    import torch

    cotangents = torch_cotangents(reference_fn, inputs, rand)
    outs, wanted, grads = _outputs_and_grads(fn, inputs, cotangents)
    ref_outs, _, ref_grads = _outputs_and_grads(reference_fn, inputs, cotangents)
    assert wanted, "no input requires grad"
    pairs = [(f"out {i}", a, e) for i, (a, e) in enumerate(zip(outs, ref_outs)) if e is not None]
    pairs += [(f"d {name}", a, e) for name, a, e in zip(wanted, grads, ref_grads)]
    for what, actual, expected in pairs:
        tol_r, tol_a = (overrides or {}).get(what, (rtol, atol))
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != reference {expected.dtype}"
        assert not torch.isnan(actual).any(), f"{what}: NaN ({rand})"
        torch.testing.assert_close(actual, expected, rtol=tol_r, atol=tol_a, msg=lambda m, w=what: f"{w}: {m} ({rand})")
    return dict(zip(wanted, grads))


def check_compiled_matches_eager(fn, inputs: dict, *, rand, backend="aot_eager"):
    """fn under torch.compile(fullgraph=True) gives eager's outputs and, for inputs that require grad, gradients,
    exactly: the wrapper's Python (checks, casts, views) traces without a graph break, and the op, its fake and its
    backward op compose."""
    import torch

    differentiable = any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values())
    cotangents = torch_cotangents(fn, inputs, rand) if differentiable else None
    eager_outs, _, eager_grads = _outputs_and_grads(fn, inputs, cotangents)
    torch._dynamo.reset()
    compiled_fn = torch.compile(fn, fullgraph=True, backend=backend)
    compiled_outs, _, compiled_grads = _outputs_and_grads(compiled_fn, inputs, cotangents)
    assert len(compiled_outs) == len(eager_outs)
    for e, c in zip(eager_outs + eager_grads, compiled_outs + compiled_grads):
        if e is None:
            assert c is None
            continue
        assert not torch.isnan(c).any(), f"NaN in the compiled result ({rand})"
        torch.testing.assert_close(c, e, rtol=0, atol=0)


def export_torch_op_for_tpu(op, args):
    """Rung 2 for a torch op: its JAX function (`op.jax_fn`; a derived backward op's too) exported for TPU on the
    shapes and dtypes of `args`' tensors (the other arguments static), which is what TorchTPU's jax_op does when the
    op is called on `tpu` tensors."""
    import torch

    dtypes = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}
    dtypes |= {torch.int32: jnp.int32, torch.float8_e4m3fn: jnp.float8_e4m3fn}
    tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    specs = [jax.ShapeDtypeStruct(tuple(args[i].shape), dtypes[args[i].dtype]) for i in tensor_at]

    def with_statics(*arrays):
        full = list(args)
        for i, array in zip(tensor_at, arrays):
            full[i] = array
        return op.jax_fn(*full)

    return export_for_tpu(with_statics, *specs)
