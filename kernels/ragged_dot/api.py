"""Public JAX API of the ragged dot (grouped matmul): validation, block choice and custom_vjp wiring.

Semantics are `jax.lax.ragged_dot`'s: lhs [M, K] with rows sorted by group, rhs [G, K, N] (or [G, N, K] with
`rhs_transposed`), group_sizes [G] int32; group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])) and
out[r] = lhs[r] @ rhs[g(r)]; rows past sum(group_sizes) come out zero. Output dtype: `preferred_element_type`, else
the promoted dtype of lhs and rhs. Accumulation is always f32.

Local group window (expert parallelism). `group_offset` and `num_local_groups` say that only groups
[group_offset, group_offset + num_local_groups) live here; rows of every other group come out zero. group_sizes
always covers every group (G entries, as the router produced them), so each shard sees the same row layout. rhs may
hold either
  - only the window: rhs.shape[0] == num_local_groups (the expert-parallel layout: each shard holds its slice of
    the expert weights, and group_offset = shard index * num_local_groups, possibly a traced value such as
    `jax.lax.axis_index(...) * n` inside shard_map), or
  - every group: rhs.shape[0] == G, of which only the window is used.
num_local_groups defaults to G (no window; rhs must then hold G groups). group_offset is a Python int or an integer
scalar array (shape () or (1,)); a concrete one is checked to keep the window inside [0, G); a traced one cannot be,
and window groups outside [0, G) then contribute nothing.

Row scale (for the MoE down projection): `row_scale` [M] multiplies each output row last, in the kernel's epilogue
(the routing weight of each sorted (token, expert) row), so the weighted rows are written once.

Fused epilogue (for the MoE gate/up projection): `bias` [rhs groups, N] is added per group; `activation` in
{None, "silu", "gelu_tanh"}; with `gated="concatenated"` (gate = columns [0, N/2), up = [N/2, N)) or
`gated="interleaved"` (gate = even columns, up = odd) the output is act(gate) * up, of width N/2, written once.
Layouts the kernel cannot split into aligned gate/up blocks (see `_fusable`) are computed unfused (the grouped matmul
in f32, then the epilogue in XLA), which is correct but does an extra pass over the [M, N] intermediate.

Checks that need values (negative group sizes, sizes summing past M, the window of a concrete group_offset) run when
those values are concrete; under jit they are traced and unchecked: the kernel then treats negative sizes as zero and
drops rows past M, so it never reads or writes out of bounds.

Differentiable in lhs, rhs, bias and row_scale, including through the activation/gated epilogue (its backward
recomputes the pre-activation with the forward kernel and differentiates the epilogue and the row scale in XLA).
group_sizes and group_offset get no gradient.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..common import chip
from ..common.interpret import interpret_eager_cpu_calls
from ..common.validation import check_array
from . import kernel, reference, tuning

MATMUL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ACTIVATIONS = (None, "silu", "gelu_tanh")
GATED = (None, "concatenated", "interleaved")


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static facts of one call (hashable: a custom_vjp non-differentiable argument)."""

    out_dtype: jnp.dtype
    rhs_transposed: bool
    num_local_groups: int
    rhs_global: bool  # rhs holds every group (index = group_offset + local index), else only the window
    activation: str | None
    gated: str | None
    static_grid: bool


def _is_concrete(x) -> bool:
    """Values known now: a concrete jax or numpy array (not a tracer, not a ShapeDtypeStruct placeholder)."""
    return isinstance(x, (jax.Array, np.ndarray)) and not isinstance(x, jax.core.Tracer)


def _check_group_offset(group_offset):
    if isinstance(group_offset, bool):
        raise TypeError("group_offset: expected an int or an integer scalar array, got bool")
    if isinstance(group_offset, (int, np.integer)):
        return int(group_offset)
    if not hasattr(group_offset, "dtype") or not jnp.issubdtype(group_offset.dtype, jnp.integer):
        raise TypeError(f"group_offset: expected an int or an integer scalar array, got {type(group_offset).__name__}")
    if tuple(group_offset.shape) not in ((), (1,)):
        raise ValueError(f"group_offset: expected shape () or (1,), got {tuple(group_offset.shape)}")
    group_offset = jnp.asarray(group_offset).reshape(()).astype(jnp.int32)
    if _is_concrete(group_offset):
        return int(group_offset)
    return group_offset


def check_inputs(
    lhs,
    rhs,
    group_sizes,
    *,
    preferred_element_type,
    rhs_transposed,
    group_offset,
    num_local_groups,
    bias,
    activation,
    gated,
    row_scale=None,
):
    """Validate ragged_dot's arguments; return (config, group_offset as int or traced int32 scalar, n_out)."""
    lhs_dtype = check_array("lhs", lhs, ndim=2, dtypes=MATMUL_DTYPES)
    rhs_dtype = check_array("rhs", rhs, ndim=3, dtypes=MATMUL_DTYPES)
    check_array("group_sizes", group_sizes, ndim=1, dtypes=(jnp.dtype(jnp.int32),))
    if not isinstance(rhs_transposed, (bool, np.bool_)):
        raise TypeError(f"rhs_transposed: expected a bool, got {type(rhs_transposed).__name__}")
    m, k = lhs.shape
    num_groups = group_sizes.shape[0]
    rhs_groups = rhs.shape[0]
    rhs_k, n = (rhs.shape[2], rhs.shape[1]) if rhs_transposed else (rhs.shape[1], rhs.shape[2])
    layout = "[G, N, K] (rhs_transposed=True)" if rhs_transposed else "[G, K, N]"
    if rhs_k != k:
        raise ValueError(
            f"rhs: contraction dimension {rhs_k} of rhs {tuple(rhs.shape)} (layout {layout}) does not match lhs's "
            f"K = {k} (lhs shape {tuple(lhs.shape)})"
        )
    if preferred_element_type is None:
        out_dtype = jnp.promote_types(lhs_dtype, rhs_dtype)
    else:
        try:
            out_dtype = jnp.dtype(preferred_element_type)
        except TypeError as e:
            raise TypeError(f"preferred_element_type: expected a float dtype, got {preferred_element_type!r}") from e
        if out_dtype not in OUT_DTYPES:
            raise TypeError(
                f"preferred_element_type: expected one of ({', '.join(map(str, OUT_DTYPES))}), got {out_dtype}"
            )
    if num_local_groups is None:
        if rhs_groups != num_groups:
            raise ValueError(
                f"rhs: expected {num_groups} groups (len(group_sizes)) in dimension 0, got shape {tuple(rhs.shape)}; "
                "for a local group window pass num_local_groups (and group_offset)"
            )
        n_local = rhs_groups
    else:
        if isinstance(num_local_groups, bool) or not isinstance(num_local_groups, (int, np.integer)):
            raise TypeError(f"num_local_groups: expected an int, got {type(num_local_groups).__name__}")
        n_local = int(num_local_groups)
    if n_local < 0 or n_local > num_groups:
        raise ValueError(
            f"num_local_groups: expected 0 <= num_local_groups <= {num_groups} (len(group_sizes)), got {n_local}"
        )
    if rhs_groups not in (n_local, num_groups):
        raise ValueError(
            f"rhs: expected {n_local} groups (the local window, num_local_groups) or {num_groups} (every group, "
            f"len(group_sizes)) in dimension 0, got shape {tuple(rhs.shape)}"
        )
    rhs_global = rhs_groups == num_groups and n_local != num_groups
    group_offset = _check_group_offset(group_offset)
    if isinstance(group_offset, int) and not (0 <= group_offset and group_offset + n_local <= num_groups):
        raise ValueError(
            f"group_offset: the window [group_offset, group_offset + num_local_groups) = [{group_offset}, "
            f"{group_offset + n_local}) must lie inside [0, {num_groups}) (len(group_sizes))"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if gated not in GATED:
        raise ValueError(f"gated: expected one of {GATED}, got {gated!r}")
    if gated is not None and n % 2:
        raise ValueError(f"rhs: gated={gated!r} needs an even number of output columns N, got N = {n}")
    if bias is not None:
        check_array("bias", bias, ndim=2, dtypes=MATMUL_DTYPES)
        if tuple(bias.shape) != (rhs_groups, n):
            raise ValueError(f"bias: expected shape {(rhs_groups, n)} (rhs groups, N), got {tuple(bias.shape)}")
    if row_scale is not None:
        check_array("row_scale", row_scale, ndim=1, dtypes=MATMUL_DTYPES)
        if row_scale.shape[0] != m:
            raise ValueError(f"row_scale: expected shape ({m},) (lhs rows), got {tuple(row_scale.shape)}")
    if _is_concrete(group_sizes):
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any():
            bad = int(np.flatnonzero(sizes < 0)[0])
            raise ValueError(f"group_sizes: expected sizes >= 0, got group_sizes[{bad}] = {int(sizes[bad])}")
        total = int(sizes.astype(np.int64).sum())
        if total > m:
            raise ValueError(f"group_sizes: the sizes sum to {total}, more than lhs's {m} rows")
    cfg = _Config(
        out_dtype=jnp.dtype(out_dtype),
        rhs_transposed=bool(rhs_transposed),
        num_local_groups=n_local,
        rhs_global=rhs_global,
        activation=activation,
        gated=gated,
        static_grid=False,
    )
    return cfg, group_offset, (n // 2 if gated else n)


def _info():
    return chip.current_tpu_info()


def _as_stored(rhs, rhs_transposed):
    """rhs in the orientation XLA stores it in (see tuning.stored_minor_to_major_swapped): the swap is a bitcast of
    the weights as they sit in HBM, where the logical orientation would cost a relayout copy of all of them."""
    if tuning.stored_minor_to_major_swapped(rhs.shape[1], rhs.shape[2]):
        return jnp.swapaxes(rhs, 1, 2), not rhs_transposed
    return rhs, rhs_transposed


def _plain_forward(
    lhs,
    rhs,
    bias2d,
    group_sizes,
    group_offset,
    *,
    out_dtype,
    rhs_transposed,
    n_local,
    rhs_global,
    static_grid,
    row_scale=None,
):
    """Grouped matmul (+ bias) with no epilogue, through the forward kernel."""
    rhs, rhs_transposed = _as_stored(rhs, rhs_transposed)
    m, k = lhs.shape
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    blocks = tuning.choose_blocks(
        m,
        k,
        n,
        num_groups=n_local,
        lhs_dtype=lhs.dtype,
        rhs_dtype=rhs.dtype,
        out_dtype=out_dtype,
        rhs_transposed=rhs_transposed,
        info=_info(),
    )
    bias = () if bias2d is None else (bias2d[:, None, :],)
    return kernel.ragged_dot_forward(
        lhs,
        rhs,
        group_sizes,
        out_dtype=out_dtype,
        blocks=blocks,
        rhs_transposed=rhs_transposed,
        group_offset=group_offset,
        num_local_groups=n_local,
        rhs_group_base=group_offset if rhs_global else 0,
        bias=bias,
        static_grid=static_grid,
        row_scale=_scale_column(row_scale),
    )


def _scale_column(row_scale):
    return None if row_scale is None else row_scale.astype(jnp.float32)[:, None]


def _fusable(gated, rhs_transposed, half_n, rhs_dtype) -> bool:
    """Whether the gate and up halves can be read as whole, aligned blocks of rhs (no copy of the weights)."""
    if gated is None:
        return True
    sub = tuning.sublane_multiple(rhs_dtype)
    if gated == "concatenated":
        # Gate/up blocks along N: lanes (multiples of 128) unless rhs is transposed (sublanes); the output block
        # (tm, tn) is legal for tn = half_n or a multiple of 128.
        return half_n % 128 == 0 if not rhs_transposed else half_n % sub == 0
    # Interleaved: gate/up alternate along N; splitting a weight block into even/odd rows or lanes is not
    # supported by Mosaic's strided loads for bf16, so this layout runs unfused. For decode the extra [M, N] f32
    # pass is small beside the weights; for prefill it costs about one more read and write of the intermediate.
    return False


def _fused_forward(cfg: _Config, lhs, rhs, bias2d, row_scale, group_sizes, group_offset):
    m, k = lhs.shape
    n_full = rhs.shape[1] if cfg.rhs_transposed else rhs.shape[2]
    if cfg.gated is None and cfg.activation is None:
        return _plain_forward(
            lhs,
            rhs,
            bias2d,
            group_sizes,
            group_offset,
            out_dtype=cfg.out_dtype,
            rhs_transposed=cfg.rhs_transposed,
            n_local=cfg.num_local_groups,
            rhs_global=cfg.rhs_global,
            static_grid=cfg.static_grid,
            row_scale=row_scale,
        )
    half = n_full // 2
    if not _fusable(cfg.gated, cfg.rhs_transposed, half, rhs.dtype):
        h = _plain_forward(
            lhs,
            rhs,
            bias2d,
            group_sizes,
            group_offset,
            out_dtype=jnp.float32,
            rhs_transposed=cfg.rhs_transposed,
            n_local=cfg.num_local_groups,
            rhs_global=cfg.rhs_global,
            static_grid=cfg.static_grid,
        )
        out = _epilogue(h, cfg)
        if row_scale is not None:
            out = out * row_scale.astype(jnp.float32)[:, None]
        return out.astype(cfg.out_dtype)
    n_out = half if cfg.gated else n_full
    rhs_transposed = cfg.rhs_transposed
    stored, stored_transposed = _as_stored(rhs, rhs_transposed)
    if _fusable(cfg.gated, stored_transposed, half, rhs.dtype):
        rhs, rhs_transposed = stored, stored_transposed
    blocks = tuning.choose_blocks(
        m,
        k,
        n_out,
        num_groups=cfg.num_local_groups,
        lhs_dtype=lhs.dtype,
        rhs_dtype=rhs.dtype,
        out_dtype=cfg.out_dtype,
        rhs_transposed=rhs_transposed,
        gated=cfg.gated is not None,
        half_n=half if cfg.gated else None,
        info=_info(),
    )
    if bias2d is None:
        bias = ()
    elif cfg.gated == "concatenated":
        bias = (bias2d[:, None, :half], bias2d[:, None, half:])
    else:
        bias = (bias2d[:, None, :],)
    return kernel.ragged_dot_forward(
        lhs,
        rhs,
        group_sizes,
        out_dtype=cfg.out_dtype,
        blocks=blocks,
        rhs_transposed=rhs_transposed,
        group_offset=group_offset,
        num_local_groups=cfg.num_local_groups,
        rhs_group_base=group_offset if cfg.rhs_global else 0,
        bias=bias,
        gated=cfg.gated,
        activation=cfg.activation,
        static_grid=cfg.static_grid,
        row_scale=_scale_column(row_scale),
    )


def _epilogue(h, cfg: _Config):
    """act / act(gate) * up on the f32 pre-activation h [M, N] (rows outside the window are 0 and stay 0)."""
    if cfg.gated is None:
        return reference.activation_reference(h, cfg.activation)
    if cfg.gated == "concatenated":
        half = h.shape[1] // 2
        gate, up = h[:, :half], h[:, half:]
    else:
        gate, up = h[:, 0::2], h[:, 1::2]
    return reference.activation_reference(gate, cfg.activation) * up


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_dot(cfg: _Config, lhs, rhs, bias2d, row_scale, group_sizes, group_offset):
    return _fused_forward(cfg, lhs, rhs, bias2d, row_scale, group_sizes, group_offset)


def _ragged_dot_fwd(cfg, lhs, rhs, bias2d, row_scale, group_sizes, group_offset):
    out = _fused_forward(cfg, lhs, rhs, bias2d, row_scale, group_sizes, group_offset)
    return out, (lhs, rhs, bias2d, row_scale, group_sizes, group_offset)


def _ragged_dot_bwd(cfg: _Config, saved, g):
    lhs, rhs, bias2d, row_scale, group_sizes, group_offset = saved
    m, k = lhs.shape
    n_local = cfg.num_local_groups
    has_epilogue = cfg.gated is not None or cfg.activation is not None
    d_row_scale = None
    if has_epilogue or row_scale is not None:
        # Recompute the pre-activation (f32); differentiate the row scale and the epilogue in XLA.
        h = _plain_forward(
            lhs,
            rhs,
            bias2d,
            group_sizes,
            group_offset,
            out_dtype=jnp.float32,
            rhs_transposed=cfg.rhs_transposed,
            n_local=n_local,
            rhs_global=cfg.rhs_global,
            static_grid=cfg.static_grid,
        )
        g = g.astype(jnp.float32)
        if row_scale is not None:
            unscaled = _epilogue(h, cfg) if has_epilogue else h
            d_row_scale = jnp.sum(g * unscaled, axis=1).astype(row_scale.dtype)
            g = g * row_scale.astype(jnp.float32)[:, None]
        if has_epilogue:
            _, epilogue_vjp = jax.vjp(lambda h: _epilogue(h, cfg), h)
            (g,) = epilogue_vjp(g)
    # d lhs: the same grouped matmul against rhs read the other way round; rows outside the window get zero.
    dlhs = _plain_forward(
        g,
        rhs,
        None,
        group_sizes,
        group_offset,
        out_dtype=lhs.dtype,
        rhs_transposed=not cfg.rhs_transposed,
        n_local=n_local,
        rhs_global=cfg.rhs_global,
        static_grid=cfg.static_grid,
    )
    # d rhs: per group, lhs[rows]^T @ g[rows] ([K, N]), or g[rows]^T @ lhs[rows] for the transposed layout.
    a, b = (g, lhs) if cfg.rhs_transposed else (lhs, g)
    tblocks = tuning.choose_transposed_blocks(
        m,
        a.shape[1],
        b.shape[1],
        num_groups=n_local,
        a_dtype=a.dtype,
        b_dtype=b.dtype,
        out_dtype=rhs.dtype,
        info=_info(),
    )
    drhs = kernel.transposed_ragged_dot(
        a,
        b,
        group_sizes,
        out_dtype=rhs.dtype,
        blocks=tblocks,
        group_offset=group_offset,
        num_local_groups=n_local,
        static_grid=cfg.static_grid,
    )
    dbias = None
    if bias2d is not None:
        local = reference.row_groups(group_sizes, m) - group_offset
        local = jnp.where((local >= 0) & (local < n_local), local, n_local)
        dbias = jax.ops.segment_sum(g.astype(jnp.float32), local, num_segments=n_local + 1)[:n_local]
        dbias = dbias.astype(bias2d.dtype)
    if cfg.rhs_global:
        start = jnp.asarray(group_offset, jnp.int32)
        drhs = jax.lax.dynamic_update_slice(jnp.zeros(rhs.shape, rhs.dtype), drhs, (start, 0, 0))
        if dbias is not None:
            dbias = jax.lax.dynamic_update_slice(jnp.zeros(bias2d.shape, bias2d.dtype), dbias, (start, 0))
    return dlhs, drhs, dbias, d_row_scale, None, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


@interpret_eager_cpu_calls
def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    rhs_transposed: bool = False,
    group_offset=0,
    num_local_groups: int | None = None,
    bias: jax.Array | None = None,
    activation: str | None = None,
    gated: str | None = None,
    row_scale: jax.Array | None = None,
    static_grid: bool = False,
) -> jax.Array:
    """Grouped matmul with `jax.lax.ragged_dot` semantics, an optional local group window and fused epilogue.

    lhs [M, K] (f32/bf16), rows sorted by group; rhs [R, K, N] or [R, N, K] (rhs_transposed) (f32/bf16), R = G or
    num_local_groups; group_sizes [G] int32. Returns [M, N] (or [M, N/2] when gated) in preferred_element_type or
    the promoted input dtype. row_scale [M] (f32/bf16) multiplies each output row last. See the module docstring for
    the window, the epilogue and what is checked when.
    `static_grid=True` sizes the kernel grid by the worst-case visit count instead of the real one (for comparison).
    """
    cfg, group_offset, n_out = check_inputs(
        lhs,
        rhs,
        group_sizes,
        preferred_element_type=preferred_element_type,
        rhs_transposed=rhs_transposed,
        group_offset=group_offset,
        num_local_groups=num_local_groups,
        bias=bias,
        activation=activation,
        gated=gated,
        row_scale=row_scale,
    )
    cfg = dataclasses.replace(cfg, static_grid=bool(static_grid))
    m, k = lhs.shape
    if m == 0 or n_out == 0:
        return jnp.zeros((m, n_out), cfg.out_dtype)
    if cfg.num_local_groups == 0:
        return jnp.zeros((m, n_out), cfg.out_dtype)
    if k == 0:
        # Nothing to contract: each row is its group's bias (or zero) through the epilogue; the reference is exact.
        n_full = rhs.shape[1] if rhs_transposed else rhs.shape[2]
        unit_rhs = jnp.zeros((rhs.shape[0],) + ((n_full, 1) if rhs_transposed else (1, n_full)), rhs.dtype)
        return reference.ragged_dot_reference(
            jnp.zeros((m, 1), lhs.dtype),
            unit_rhs,
            group_sizes,
            preferred_element_type=cfg.out_dtype,
            rhs_transposed=rhs_transposed,
            group_offset=group_offset,
            num_local_groups=cfg.num_local_groups,
            bias=bias,
            activation=activation,
            gated=gated,
            row_scale=row_scale,
        )
    return _ragged_dot(cfg, lhs, rhs, bias, row_scale, group_sizes, group_offset)
