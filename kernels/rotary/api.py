"""Public JAX API of the rotary kernels: input validation, layout handling, block choice and custom_vjp wiring.

    apply_rotary(q, k, cos, sin)                    transformers' apply_rotary_pos_emb, one pass over q and k
    apply_rotary_backward(grad_q, grad_k, cos, sin) its transpose (the gradient in q and k)
    rms_norm_rope(q, k, q_weight, k_weight, cos, sin)   per-head RMSNorm (Qwen3 / Gemma 4 q_norm, k_norm), then RoPE
    apply_rotary_from_positions(q, k, positions, theta=...)   cos/sin computed in the kernel, no tables in HBM
    apply_rotary_from_positions_backward(grad_q, grad_k, positions, theta=...)   its transpose
    rms_norm_rope_from_positions(...)               both

Shapes. layout="bhsd" (transformers' attention layout): q [B, Hq, S, D], k [B, Hk, S, D]; layout="bshd": q
[B, S, Hq, D], k [B, S, Hk, D]. Hq and Hk may differ (GQA); B, S and D must agree. k may be None (then the second
result is None). cos/sin [B, S, r] or [1, S, r] (one table shared by the batch, what transformers builds from
position_ids of batch 1); r = rotary_dim: the first r features of each head rotate, the remaining D - r pass through
unchanged (partial rotary, as GPT-NeoX / Phi / GLM do; Gemma 4's "proportional" partial rotary instead uses
full-width tables whose trailing frequencies are zero, which is the default r = D). `interleaved=True` is the
GPT-J pairing (2i, 2i+1) instead of rotate_half's (i, i + r/2); cos/sin are then laid out per pair element the
same way (each frequency repeated twice). The rotation is out = x * cos + rotate_half(x) * sin for any cos/sin.

Numerics: math in f32, results in q's dtype. q/k in float32 or bfloat16; cos/sin in float32 or bfloat16. Differentiable
in q, k, cos, sin and the norm weights (cos/sin and weight gradients are reduced in XLA; q/k gradients are a kernel).

Tiling: every op takes `blocks=` (a RotaryBlocks: token blocks, VMEM limit, factor-row path), checked before anything
is traced; None means the tuning table's. See RotaryBlocks for what the sizes count and which blocks a gradient uses.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..common import chip
from ..common.interpret import interpret_eager_cpu_calls
from ..common.manual_axes import cotangents_like
from ..common.validation import check_array, check_finite, check_finite_nonnegative, is_concrete
from ..rms_norm import api as rms_norm_api
from . import frequencies, kernel, tuning
from .tuning import RotaryBlocks

ROPE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
LAYOUTS = ("bhsd", "bshd")
# Positions go through float32 as transformers' rotary embedding does (position_ids.float()); above 2**24 they are
# no longer exact.
MAX_POSITION = 1 << 24


# ------------------------------------------------------------------------------------------------------- validation
@dataclasses.dataclass(frozen=True)
class _Shape:
    batch: int
    seq: int
    head_dim: int
    seq_major: bool


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}")
    return layout == "bshd"


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


def _check_qk(q, k, layout) -> _Shape:
    seq_major = _check_layout(layout)
    dtype = check_array("q", q, ndim=4, dtypes=ROPE_DTYPES)
    batch, seq, head_dim = q.shape[0], q.shape[1 if seq_major else 2], q.shape[3]
    if k is not None:
        check_array("k", k, ndim=4, dtypes=(dtype,))
        k_bsd = (k.shape[0], k.shape[1 if seq_major else 2], k.shape[3])
        if k_bsd != (batch, seq, head_dim):
            raise ValueError(
                f"k: expected the batch, seq and head_dim of q ({batch}, {seq}, {head_dim}) in layout {layout!r}, "
                f"got shape {tuple(k.shape)}"
            )
    return _Shape(batch, seq, head_dim, seq_major)


def _check_rotary_dim(rotary_dim, head_dim, what="rotary_dim"):
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)):
        raise TypeError(f"{what}: expected an int, got {type(rotary_dim).__name__}")
    rotary_dim = int(rotary_dim)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"{what}: expected an even number > 0 (features rotate in pairs), got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"{what}: expected at most head_dim = {head_dim}, got {rotary_dim}")
    return rotary_dim


def _check_tables(cos, sin, shape: _Shape, rotary_dim):
    check_array("cos", cos, ndim=3, dtypes=ROPE_DTYPES)
    check_array("sin", sin, ndim=3, dtypes=(jnp.dtype(cos.dtype),))
    if cos.shape[0] not in (1, shape.batch) or cos.shape[1] != shape.seq:
        raise ValueError(
            f"cos: expected shape ({shape.batch} or 1, {shape.seq}, rotary_dim) for q's batch {shape.batch} and "
            f"seq {shape.seq}, got {tuple(cos.shape)}"
        )
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"sin: expected the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    width = cos.shape[2]
    if rotary_dim is not None and (isinstance(rotary_dim, bool) or rotary_dim != width):
        raise ValueError(f"rotary_dim: expected the width of cos and sin ({width}) or None, got {rotary_dim!r}")
    return _check_rotary_dim(width, shape.head_dim, what="rotary_dim (cos.shape[-1])")


def check_inputs(q, k, cos, sin, *, interleaved=False, rotary_dim=None, layout="bhsd"):
    """Validate apply_rotary arguments (arrays or ShapeDtypeStructs); returns the rotary dim."""
    shape = _check_qk(q, k, layout)
    _check_bool("interleaved", interleaved)
    return _check_tables(cos, sin, shape, rotary_dim)


def check_norm_inputs(q, k, q_weight, k_weight, cos, sin, *, eps, weight_offset, interleaved=False, layout="bhsd"):
    """Validate rms_norm_rope arguments; returns (eps, weight_offset)."""
    check_inputs(q, k, cos, sin, interleaved=interleaved, layout=layout)
    check_norm_weights(q, k, q_weight, k_weight)
    return check_finite_nonnegative("eps", eps), check_finite("weight_offset", weight_offset)


def check_norm_weights(q, k, q_weight, k_weight):
    head_dim = q.shape[3]
    for name, w, x in (("q_weight", q_weight, q), ("k_weight", k_weight, k)):
        if x is None:
            if w is not None:
                raise ValueError(f"{name}: given without k")
            continue
        if w is None:
            raise ValueError(f"{name}: expected a [{head_dim}] norm weight, got None")
        check_array(name, w, ndim=1, dtypes=ROPE_DTYPES)
        if w.shape[0] != head_dim:
            raise ValueError(f"{name}: expected shape ({head_dim},) to match head_dim, got {tuple(w.shape)}")


def check_position_inputs(q, k, positions, *, theta, rotary_dim=None, scaling=None, interleaved=False, layout="bhsd"):
    """Validate apply_rotary_from_positions arguments; returns (inv_freq, attention_scaling, rotated lanes)."""
    shape = _check_qk(q, k, layout)
    _check_bool("interleaved", interleaved)
    check_array("positions", positions, ndim=2, dtypes=(jnp.dtype(jnp.int32),))
    if positions.shape[0] not in (1, shape.batch) or positions.shape[1] != shape.seq:
        raise ValueError(
            f"positions: expected shape ({shape.batch} or 1, {shape.seq}) for q's batch and seq, "
            f"got {tuple(positions.shape)}"
        )
    if is_concrete(positions) and positions.size:
        values = np.asarray(positions)
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= MAX_POSITION:
            raise ValueError(
                f"positions: expected values in [0, {MAX_POSITION}) (exact in float32, as transformers computes "
                f"the angles), got values in [{low}, {high}]"
            )
    theta = check_finite_nonnegative("theta", theta)
    if theta <= 1.0:
        raise ValueError(f"theta: expected a rope base > 1, got {theta}")
    rotary_dim = _check_rotary_dim(shape.head_dim if rotary_dim is None else rotary_dim, shape.head_dim)
    return frequencies.inverse_frequencies(shape.head_dim, theta, rotary_dim, scaling)


# ----------------------------------------------------------------------------------------------------- the kernels
def _heads(x, seq_major):
    return x.shape[2] if seq_major else x.shape[1]


def _table_width(rotary_dim, head_dim):
    """Lanes of the table the kernel sees: the rotary prefix itself when it is all of D or lane-aligned (the kernel
    slices it), else padded to D (cos 1, sin 0; positions: frequency 0) and masked in the kernel."""
    return rotary_dim if (rotary_dim == head_dim or rotary_dim % 128 == 0) else head_dim


def _run(xs, ws, table_a, table_b, cfg: kernel.RopeConfig, blocks: RotaryBlocks):
    # Norm weights [D] as (D // 128, 128): a bitcast in XLA's TPU layouts, where (1, D) at D = 256, 512 is a copy.
    ws2d = [w.reshape(-1, 128) if w.shape[0] % 128 == 0 else w.reshape(1, -1) for w in ws] if cfg.norm else []
    return kernel.rope(list(xs), table_a, table_b, ws2d, cfg=cfg, blocks=blocks)


def _cos_sin_tables(cos, sin, head_dim):
    width = _table_width(cos.shape[-1], head_dim)
    if width == cos.shape[-1]:
        return cos, sin
    pad = [(0, 0), (0, 0), (0, width - cos.shape[-1])]
    return jnp.pad(cos, pad, constant_values=1), jnp.pad(sin, pad, constant_values=0)


def _kernel_on_tables(xs, ws, cos, sin, cfg, blocks):
    """Apply the kernel to the non-empty arrays of xs; empty ones come back as they are."""
    live = [i for i, x in enumerate(xs) if x.size]
    if not live:
        return list(xs)
    table_a, table_b = _cos_sin_tables(cos, sin, xs[live[0]].shape[3])
    outs = _run([xs[i] for i in live], [ws[i] for i in live] if cfg.norm else [], table_a, table_b, cfg, blocks)
    result = list(xs)
    for i, out in zip(live, outs):
        result[i] = out
    return result


# cos/sin tables: custom_vjp over (xs, ws, cos, sin); cfg and the (resolved) blocks are static.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _rope_tables(xs, ws, cos, sin, cfg, blocks):
    return tuple(_kernel_on_tables(xs, ws, cos, sin, cfg, blocks))


def _rope_tables_fwd(xs, ws, cos, sin, cfg, blocks):
    return _rope_tables(xs, ws, cos, sin, cfg, blocks), (xs, ws, cos, sin)


def _rotated_half(x, interleaved):
    """rotate_half of x (..., r) as the kernel pairs lanes: lane j takes its partner p(j)'s value, negated on the
    first lane of each pair (pairs (j, j + r/2), or (2i, 2i + 1) when interleaved)."""
    r = x.shape[-1]
    lanes = np.arange(r)
    if interleaved:
        partner = x.reshape(x.shape[:-1] + (r // 2, 2))[..., ::-1].reshape(x.shape)
        first = lanes % 2 == 0
    else:
        partner = jnp.roll(x, r // 2, axis=-1)
        first = lanes < r // 2
    return partner * np.where(first, -1.0, 1.0).astype(np.float32)


def _table_gradients(xs, ws, grads, cos, sin, cfg):
    """(d cos, d sin) of out = y * cos + rotate_half(y) * sin on the first r lanes, y = x (normalised and scaled by
    its weight under the norm), for output cotangents `grads`: per token, summed over the heads of every x, and over
    the batch and the tokens where the table has one row for them (cos [1, S, r], a decode batch's [1, 1, r])."""
    r = cos.shape[-1]
    head_axis = 2 if cfg.seq_major else 1
    dcos = dsin = 0.0
    for i, (x, g) in enumerate(zip(xs, grads)):
        y = x.astype(jnp.float32)
        if cfg.norm:
            rstd = jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + cfg.eps)
            y = y * rstd * (ws[i].astype(jnp.float32) + cfg.weight_offset)
        y, g = y[..., :r], g.astype(jnp.float32)[..., :r]
        dcos = dcos + jnp.sum(g * y, axis=head_axis)
        dsin = dsin + jnp.sum(g * _rotated_half(y, cfg.interleaved), axis=head_axis)
    shared = tuple(a for a in (0, 1) if cos.shape[a] == 1 and dcos.shape[a] != 1)
    if shared:
        dcos, dsin = dcos.sum(axis=shared, keepdims=True), dsin.sum(axis=shared, keepdims=True)
    return dcos.astype(cos.dtype), dsin.astype(sin.dtype)


def _rope_tables_bwd(cfg, blocks, saved, grads):
    xs, ws, cos, sin = saved
    grads = [g.astype(x.dtype) for g, x in zip(grads, xs)]
    rotation_t = dataclasses.replace(cfg, transpose=True, norm=False)
    # The transpose rotation of the output gradient: the forward's blocks fit it (same arrays, same tables).
    g_rot = _kernel_on_tables(grads, [], cos, sin, rotation_t, blocks)
    if cfg.norm:
        dxs, dws = [], []
        for g, x, w in zip(g_rot, xs, ws):
            dx, dw = rms_norm_api.rms_norm_backward(g, x, w, cfg.eps, weight_offset=cfg.weight_offset)
            dxs.append(dx)
            dws.append(dw)
    else:
        dxs, dws = g_rot, ws
    # cos/sin gradients: sums over heads (and the batch when the table is shared), in XLA.
    dcos, dsin = _table_gradients(xs, ws, grads, cos, sin, cfg)
    return tuple(dxs), tuple(dws), *cotangents_like((dcos, dsin), (cos, sin))


_rope_tables.defvjp(_rope_tables_fwd, _rope_tables_bwd)


# positions: custom_vjp over xs; positions carry no gradient; cfg, the inverse frequencies and the blocks are static.
def _position_tables(positions, inv_freq, interleaved, head_dim):
    inv = np.repeat(inv_freq, 2) if interleaved else np.concatenate([inv_freq, inv_freq])
    width = _table_width(len(inv), head_dim)
    inv = np.pad(inv, (0, width - len(inv))).astype(np.float32)
    return positions, jnp.asarray(inv.reshape(1, width))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rope_positions(xs, ws, positions, cfg, inv_freq, blocks):
    live = [i for i, x in enumerate(xs) if x.size]
    result = list(xs)
    if live:
        pos, inv = _position_tables(positions, np.asarray(inv_freq, np.float32), cfg.interleaved, xs[live[0]].shape[3])
        outs = _run([xs[i] for i in live], [ws[i] for i in live] if cfg.norm else [], pos, inv, cfg, blocks)
        for i, out in zip(live, outs):
            result[i] = out
    return tuple(result)


def _rope_positions_fwd(xs, ws, positions, cfg, inv_freq, blocks):
    return _rope_positions(xs, ws, positions, cfg, inv_freq, blocks), (xs, ws, positions)


def _rope_positions_bwd(cfg, inv_freq, blocks, saved, grads):
    xs, ws, positions = saved
    grads = tuple(g.astype(x.dtype) for g, x in zip(grads, xs))
    rotation_t = dataclasses.replace(cfg, transpose=True, norm=False)
    g_rot = _rope_positions(grads, (), positions, rotation_t, inv_freq, blocks)
    if cfg.norm:
        pairs = [
            rms_norm_api.rms_norm_backward(g, x, w, cfg.eps, weight_offset=cfg.weight_offset)
            for g, x, w in zip(g_rot, xs, ws)
        ]
        dxs, dws = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    else:
        dxs, dws = tuple(g_rot), ws
    return dxs, dws, None


_rope_positions.defvjp(_rope_positions_fwd, _rope_positions_bwd)


# ----------------------------------------------------------------------------------------------- layout handling
def _decode_as_tokens(x, shape: _Shape):
    """Decode (one position per sequence): B sequences of one token are run as one sequence of B tokens, x
    [1, B, H, D] (the (H, D)-tile layout). For [B, H, 1, D] and [B, 1, H, D] this reshape is a bitcast in XLA's
    layouts, as is [B, 1, r] -> [1, B, r] for the tables and [B, 1] -> [1, B] for positions, so no copy is made
    around the kernel (per-sequence blocks would have XLA relayout the tables: a copy each of cos and sin, 1.4-2 us,
    modeled v6e)."""
    if x is None or shape.seq != 1:
        return x
    return x.reshape(_kernel_shape(x, shape))


def _kernel_shape(x, shape: _Shape):
    """The shape the kernel sees for x (an array or ShapeDtypeStruct): x's own, or a decode call's [1, B, H, D]."""
    if shape.seq != 1:
        return tuple(x.shape)
    return (1, x.shape[0], _heads(x, shape.seq_major), x.shape[3])


def _tuning_shape(q, k, shape: _Shape, *, rotary_dim, table_dtypes, from_positions):
    """choose_blocks' shape arguments for the kernel on the non-empty ones of q and k (None if both are empty)."""
    seq_major = shape.seq_major or shape.seq == 1
    views = [_kernel_shape(x, shape) for x in (q, k) if x is not None and x.size]
    if not views:
        return None
    head_axis = 2 if seq_major else 1
    return dict(
        batch=views[0][0],
        seq=views[0][3 - head_axis],
        heads=tuple(v[head_axis] for v in views),
        head_dim=shape.head_dim,
        dtype=jnp.dtype(q.dtype),
        table_width=_table_width(rotary_dim, shape.head_dim),
        table_dtypes=tuple(jnp.dtype(d) for d in table_dtypes),
        seq_major=seq_major,
        from_positions=from_positions,
    )


def _blocks(blocks, q, k, shape: _Shape, **tuning_kw) -> RotaryBlocks | None:
    """The checked blocks, every field set (None when q and k are empty: no kernel runs)."""
    tuning.check_blocks_type(blocks)
    batch_given = blocks is not None and isinstance(blocks.block_batch, (int, np.integer))
    if shape.seq == 1 and batch_given and blocks.block_batch != 1:
        raise ValueError(
            f"blocks.block_batch: a decode call (seq 1) runs its {shape.batch} sequences as one sequence of "
            f"{shape.batch} tokens, so its blocks count tokens in block_seq: expected 1 or None, "
            f"got {blocks.block_batch}"
        )
    arguments = _tuning_shape(q, k, shape, **tuning_kw)
    if arguments is None:
        return None
    return tuning.resolve_blocks(blocks, **arguments, info=chip.current_tpu_info())


def tuning_arguments(q, k, tables, *, layout: str = "bhsd", rotary_dim: int | None = None, scaling=None) -> dict:
    """The shape arguments of tuning.choose_blocks / candidate_blocks for a call on q and k (arrays or
    ShapeDtypeStructs) with `tables`: (cos, sin), or integer positions for the from-positions ops (whose rotary_dim
    and scaling decide the rotated lanes). The sizes in them are the kernel's view (see RotaryBlocks)."""
    shape = _check_qk(q, k, layout)
    if isinstance(tables, (tuple, list)):
        cos, sin = tables
        return _tuning_shape(
            q, k, shape, rotary_dim=cos.shape[-1], table_dtypes=(cos.dtype, sin.dtype), from_positions=False
        )
    rope_type = frequencies.check_scaling(scaling)["rope_type"]
    rotated = shape.head_dim if rope_type == "proportional" or rotary_dim is None else rotary_dim
    return _tuning_shape(q, k, shape, rotary_dim=rotated, table_dtypes=(tables.dtype,), from_positions=True)


def _tables_as_tokens(t, shape: _Shape):
    """Tables [Bt, 1, r] or positions [Bt, 1] of a decode call as one sequence: [1, Bt, ...] (Bt = 1: shared)."""
    if shape.seq != 1:
        return t
    return t.reshape((1, t.shape[0]) + t.shape[2:])


def _call(fn, q, k, ws, shape: _Shape, *tables):
    """fn(xs, ws, *tables) on the kernel's view of q and k (and the tables); results back in the caller's shapes."""
    xs = tuple(_decode_as_tokens(x, shape) for x in ((q,) if k is None else (q, k)))
    outs = fn(xs, ws, *(_tables_as_tokens(t, shape) for t in tables))
    out_q = outs[0].reshape(q.shape)
    return out_q, (None if k is None else outs[1].reshape(k.shape))


def _config(shape: _Shape, rotary_dim, interleaved, **kw):
    return kernel.RopeConfig(
        rotary_dim=rotary_dim, interleaved=bool(interleaved), seq_major=shape.seq_major or shape.seq == 1, **kw
    )


# ------------------------------------------------------------------------------------------------------ public API
def _on_tables(q, k, ws, cos, sin, r, *, interleaved, layout, blocks, backward=False, **cfg_kw):
    """The kernel with cos/sin tables (validated by the caller): forward through the custom_vjp, or the transpose
    rotation alone (backward=True)."""
    shape = _check_qk(q, k, layout)
    blocks = _blocks(blocks, q, k, shape, rotary_dim=r, table_dtypes=(cos.dtype, sin.dtype), from_positions=False)
    cfg = _config(shape, r, interleaved, transpose=backward, **cfg_kw)
    if backward:
        fn = lambda xs, ws, c, s: tuple(_kernel_on_tables(xs, ws, c, s, cfg, blocks))  # noqa: E731
    else:
        fn = lambda xs, ws, c, s: _rope_tables(xs, ws, c, s, cfg, blocks)  # noqa: E731
    return _call(fn, q, k, ws, shape, cos, sin)


def _on_positions(
    q, k, weights, positions, *, theta, rotary_dim, scaling, interleaved, layout, blocks, backward=False, **cfg_kw
):
    """The kernel with cos/sin computed from positions, inputs validated here; weights: (q_weight, k_weight) for the
    fused norm, else None."""
    inv_freq, attention_scaling, r = check_position_inputs(
        q, k, positions, theta=theta, rotary_dim=rotary_dim, scaling=scaling, interleaved=interleaved, layout=layout
    )
    ws = ()
    if weights is not None:
        check_norm_weights(q, k, *weights)
        ws = weights[:1] if k is None else weights
    shape = _check_qk(q, k, layout)
    blocks = _blocks(blocks, q, k, shape, rotary_dim=r, table_dtypes=(positions.dtype,), from_positions=True)
    nonzero = np.flatnonzero(np.asarray(inv_freq))
    angle_lanes = max(128, -(-(int(nonzero[-1]) + 1 if nonzero.size else 0) // 128) * 128)
    cfg = _config(
        shape,
        r,
        interleaved,
        transpose=backward,
        from_positions=True,
        attention_scaling=attention_scaling,
        angle_lanes=angle_lanes,
        **cfg_kw,
    )
    inv = tuple(float(f) for f in inv_freq)
    return _call(lambda xs, ws, p: _rope_positions(xs, ws, p, cfg, inv, blocks), q, k, ws, shape, positions)


@interpret_eager_cpu_calls
def apply_rotary(
    q: jax.Array,
    k: jax.Array | None,
    cos: jax.Array,
    sin: jax.Array,
    *,
    interleaved: bool = False,
    rotary_dim: int | None = None,
    layout: str = "bhsd",
    blocks: RotaryBlocks | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(q * cos + rotate_half(q) * sin, the same for k): transformers' apply_rotary_pos_emb in one pass.

    See the module docstring for shapes. rotary_dim, when given, must equal cos.shape[-1] (a check, not a choice).
    blocks: the tiling (RotaryBlocks), None for the tuning table's.
    """
    r = check_inputs(q, k, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim, layout=layout)
    return _on_tables(q, k, (), cos, sin, r, interleaved=interleaved, layout=layout, blocks=blocks)


@interpret_eager_cpu_calls
def apply_rotary_backward(
    grad_q: jax.Array,
    grad_k: jax.Array | None,
    cos: jax.Array,
    sin: jax.Array,
    *,
    interleaved: bool = False,
    layout: str = "bhsd",
    blocks: RotaryBlocks | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gradients in q and k of apply_rotary for output gradients grad_q, grad_k: the transpose rotation,
    grad * cos - rotate_half(grad * sin) (for tables with equal halves, the rotation by -sin). blocks: the tiling
    (RotaryBlocks), None for the tuning table's."""
    r = check_inputs(grad_q, grad_k, cos, sin, interleaved=interleaved, layout=layout)
    return _on_tables(
        grad_q, grad_k, (), cos, sin, r, interleaved=interleaved, layout=layout, blocks=blocks, backward=True
    )


@interpret_eager_cpu_calls
def rms_norm_rope(
    q: jax.Array,
    k: jax.Array | None,
    q_weight: jax.Array,
    k_weight: jax.Array | None,
    cos: jax.Array,
    sin: jax.Array,
    *,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    interleaved: bool = False,
    layout: str = "bhsd",
    blocks: RotaryBlocks | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(rope(rms_norm(q) * (weight_offset + q_weight)), the same for k) in one pass: Qwen3 / Gemma 4's q_norm and
    k_norm (RMSNorm over head_dim, per head) followed by RoPE. The norm and rotation are both in f32; the result is
    rounded once. Weights [head_dim] in f32 or bf16. blocks: the tiling (RotaryBlocks), None for the tuning table's
    (the norm's gradient takes the RMSNorm table's blocks, see RotaryBlocks)."""
    eps, weight_offset = check_norm_inputs(
        q,
        k,
        q_weight,
        k_weight,
        cos,
        sin,
        eps=eps,
        weight_offset=weight_offset,
        interleaved=interleaved,
        layout=layout,
    )
    ws = (q_weight,) if k is None else (q_weight, k_weight)
    return _on_tables(
        q,
        k,
        ws,
        cos,
        sin,
        cos.shape[-1],
        interleaved=interleaved,
        layout=layout,
        blocks=blocks,
        norm=True,
        eps=eps,
        weight_offset=weight_offset,
    )


@interpret_eager_cpu_calls
def apply_rotary_from_positions(
    q: jax.Array,
    k: jax.Array | None,
    positions: jax.Array,
    *,
    theta: float,
    rotary_dim: int | None = None,
    scaling: dict | None = None,
    interleaved: bool = False,
    layout: str = "bhsd",
    blocks: RotaryBlocks | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """apply_rotary with cos/sin computed inside the kernel from integer positions [B or 1, S] (int32), as
    transformers' rotary embedding computes them (f32 angles positions * inv_freq, cos/sin scaled by the rope type's
    attention factor), so no tables cross HBM. theta: the rope base; rotary_dim: rotated features (default head_dim);
    scaling: transformers' rope_parameters dict for "linear", "llama3", "yarn" or "proportional" (Gemma 4), or None.
    The cos/sin stay in f32 (transformers rounds its tables to the model dtype first). blocks: the tiling
    (RotaryBlocks), None for the tuning table's."""
    return _on_positions(
        q,
        k,
        None,
        positions,
        theta=theta,
        rotary_dim=rotary_dim,
        scaling=scaling,
        interleaved=interleaved,
        layout=layout,
        blocks=blocks,
    )


@interpret_eager_cpu_calls
def apply_rotary_from_positions_backward(
    grad_q: jax.Array,
    grad_k: jax.Array | None,
    positions: jax.Array,
    *,
    theta: float,
    rotary_dim: int | None = None,
    scaling: dict | None = None,
    interleaved: bool = False,
    layout: str = "bhsd",
    blocks: RotaryBlocks | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gradients in q and k of apply_rotary_from_positions for output gradients grad_q, grad_k: the transpose
    rotation (by -sin), cos/sin again computed in the kernel. blocks: the tiling (RotaryBlocks), None for the tuning
    table's."""
    return _on_positions(
        grad_q,
        grad_k,
        None,
        positions,
        theta=theta,
        rotary_dim=rotary_dim,
        scaling=scaling,
        interleaved=interleaved,
        layout=layout,
        blocks=blocks,
        backward=True,
    )


@interpret_eager_cpu_calls
def rms_norm_rope_from_positions(
    q: jax.Array,
    k: jax.Array | None,
    q_weight: jax.Array,
    k_weight: jax.Array | None,
    positions: jax.Array,
    *,
    theta: float,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    rotary_dim: int | None = None,
    scaling: dict | None = None,
    interleaved: bool = False,
    layout: str = "bhsd",
    blocks: RotaryBlocks | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """rms_norm_rope with cos/sin computed in the kernel from positions (see apply_rotary_from_positions). blocks:
    the tiling (RotaryBlocks), None for the tuning table's (the norm's gradient takes the RMSNorm table's)."""
    eps, weight_offset = check_finite_nonnegative("eps", eps), check_finite("weight_offset", weight_offset)
    return _on_positions(
        q,
        k,
        (q_weight, k_weight),
        positions,
        theta=theta,
        rotary_dim=rotary_dim,
        scaling=scaling,
        interleaved=interleaved,
        layout=layout,
        blocks=blocks,
        norm=True,
        eps=eps,
        weight_offset=weight_offset,
    )


def rope_cos_sin(
    positions, *, head_dim: int, theta: float, rotary_dim: int | None = None, scaling=None, interleaved: bool = False
):
    """The cos/sin tables [B, S, r] (f32) apply_rotary_from_positions computes in the kernel, for use with
    apply_rotary or a reference."""
    rotary_dim = _check_rotary_dim(head_dim if rotary_dim is None else rotary_dim, head_dim)
    inv_freq, attention_scaling, _ = frequencies.inverse_frequencies(head_dim, theta, rotary_dim, scaling)
    return frequencies.cos_sin(positions, inv_freq, attention_scaling, interleaved=interleaved)
