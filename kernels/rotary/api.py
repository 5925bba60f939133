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
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..common import chip
from ..common.interpret import interpret_eager_cpu_calls
from ..common.validation import check_array, check_finite, check_finite_nonnegative
from ..rms_norm import api as rms_norm_api
from . import frequencies, kernel, reference, tuning

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


def _is_concrete(value):
    return isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, jax.core.Tracer)


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
    if _is_concrete(positions) and positions.size:
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


def _run(xs, ws, table_a, table_b, cfg: kernel.RopeConfig):
    x0 = xs[0]
    seq = x0.shape[1] if cfg.seq_major else x0.shape[2]
    table_dtypes = (table_a.dtype,) if cfg.from_positions else (table_a.dtype, table_b.dtype)
    blocks = tuning.choose_blocks(
        batch=x0.shape[0],
        seq=seq,
        heads=tuple(_heads(x, cfg.seq_major) for x in xs),
        head_dim=x0.shape[3],
        dtype=x0.dtype,
        table_width=table_b.shape[-1],
        table_dtypes=table_dtypes,
        seq_major=cfg.seq_major,
        from_positions=cfg.from_positions,
        info=chip.current_tpu_info(),
    )
    # Norm weights [D] as (D // 128, 128): a bitcast in XLA's TPU layouts, where (1, D) at D = 256, 512 is a copy.
    ws2d = [w.reshape(-1, 128) if w.shape[0] % 128 == 0 else w.reshape(1, -1) for w in ws] if cfg.norm else []
    return kernel.rope(list(xs), table_a, table_b, ws2d, cfg=cfg, blocks=blocks)


def _cos_sin_tables(cos, sin, head_dim):
    width = _table_width(cos.shape[-1], head_dim)
    if width == cos.shape[-1]:
        return cos, sin
    pad = [(0, 0), (0, 0), (0, width - cos.shape[-1])]
    return jnp.pad(cos, pad, constant_values=1), jnp.pad(sin, pad, constant_values=0)


def _kernel_on_tables(xs, ws, cos, sin, cfg):
    """Apply the kernel to the non-empty arrays of xs; empty ones come back as they are."""
    live = [i for i, x in enumerate(xs) if x.size]
    if not live:
        return list(xs)
    table_a, table_b = _cos_sin_tables(cos, sin, xs[live[0]].shape[3])
    outs = _run([xs[i] for i in live], [ws[i] for i in live] if cfg.norm else [], table_a, table_b, cfg)
    result = list(xs)
    for i, out in zip(live, outs):
        result[i] = out
    return result


# cos/sin tables: custom_vjp over (xs, ws, cos, sin); cfg is static.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rope_tables(xs, ws, cos, sin, cfg):
    return tuple(_kernel_on_tables(xs, ws, cos, sin, cfg))


def _rope_tables_fwd(xs, ws, cos, sin, cfg):
    return _rope_tables(xs, ws, cos, sin, cfg), (xs, ws, cos, sin)


def _reference_rotation(xs, ws, cos, sin, cfg):
    layout = "bshd" if cfg.seq_major else "bhsd"
    outs = []
    for i, x in enumerate(xs):
        xf = reference.head_rms_norm_reference(x, ws[i], cfg.eps, cfg.weight_offset) if cfg.norm else x
        rotated = reference.rotate_reference(xf, cos, sin, interleaved=cfg.interleaved, layout=layout)
        outs.append(rotated.astype(x.dtype))
    return outs


def _rope_tables_bwd(cfg, saved, grads):
    xs, ws, cos, sin = saved
    grads = [g.astype(x.dtype) for g, x in zip(grads, xs)]
    rotation_t = dataclasses.replace(cfg, transpose=True, norm=False)
    g_rot = _kernel_on_tables(grads, [], cos, sin, rotation_t)  # the transpose rotation of the output gradient
    if cfg.norm:
        dxs, dws = [], []
        for g, x, w in zip(g_rot, xs, ws):
            dx, dw = rms_norm_api.rms_norm_backward(g, x, w, cfg.eps, weight_offset=cfg.weight_offset)
            dxs.append(dx)
            dws.append(dw)
    else:
        dxs, dws = g_rot, ws
    # cos/sin gradients: sums over heads (and the batch when the table is shared), in XLA from the reference.
    _, vjp = jax.vjp(lambda c, s: _reference_rotation(xs, ws, c, s, cfg), cos, sin)
    dcos, dsin = vjp([g.astype(x.dtype) for g, x in zip(grads, xs)])
    return tuple(dxs), tuple(dws), dcos, dsin


_rope_tables.defvjp(_rope_tables_fwd, _rope_tables_bwd)


# positions: custom_vjp over xs; positions carry no gradient; cfg and the inverse frequencies are static.
def _position_tables(positions, inv_freq, interleaved, head_dim):
    inv = np.repeat(inv_freq, 2) if interleaved else np.concatenate([inv_freq, inv_freq])
    width = _table_width(len(inv), head_dim)
    inv = np.pad(inv, (0, width - len(inv))).astype(np.float32)
    return positions, jnp.asarray(inv.reshape(1, width))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rope_positions(xs, ws, positions, cfg, inv_freq):
    live = [i for i, x in enumerate(xs) if x.size]
    result = list(xs)
    if live:
        pos, inv = _position_tables(positions, np.asarray(inv_freq, np.float32), cfg.interleaved, xs[live[0]].shape[3])
        outs = _run([xs[i] for i in live], [ws[i] for i in live] if cfg.norm else [], pos, inv, cfg)
        for i, out in zip(live, outs):
            result[i] = out
    return tuple(result)


def _rope_positions_fwd(xs, ws, positions, cfg, inv_freq):
    return _rope_positions(xs, ws, positions, cfg, inv_freq), (xs, ws, positions)


def _rope_positions_bwd(cfg, inv_freq, saved, grads):
    xs, ws, positions = saved
    grads = tuple(g.astype(x.dtype) for g, x in zip(grads, xs))
    g_rot = _rope_positions(grads, (), positions, dataclasses.replace(cfg, transpose=True, norm=False), inv_freq)
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
    heads = _heads(x, shape.seq_major)
    return x.reshape(1, x.shape[0], heads, x.shape[3])


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
def _on_tables(q, k, ws, cos, sin, r, *, interleaved, layout, backward=False, **cfg_kw):
    """The kernel with cos/sin tables (validated by the caller): forward through the custom_vjp, or the transpose
    rotation alone (backward=True)."""
    shape = _check_qk(q, k, layout)
    cfg = _config(shape, r, interleaved, transpose=backward, **cfg_kw)
    if backward:
        return _call(lambda xs, ws, c, s: tuple(_kernel_on_tables(xs, ws, c, s, cfg)), q, k, ws, shape, cos, sin)
    return _call(lambda xs, ws, c, s: _rope_tables(xs, ws, c, s, cfg), q, k, ws, shape, cos, sin)


def _on_positions(
    q, k, weights, positions, *, theta, rotary_dim, scaling, interleaved, layout, backward=False, **cfg_kw
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
    return _call(lambda xs, ws, p: _rope_positions(xs, ws, p, cfg, inv), q, k, ws, shape, positions)


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
) -> tuple[jax.Array, jax.Array | None]:
    """(q * cos + rotate_half(q) * sin, the same for k): transformers' apply_rotary_pos_emb in one pass.

    See the module docstring for shapes. rotary_dim, when given, must equal cos.shape[-1] (a check, not a choice).
    """
    r = check_inputs(q, k, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim, layout=layout)
    return _on_tables(q, k, (), cos, sin, r, interleaved=interleaved, layout=layout)


@interpret_eager_cpu_calls
def apply_rotary_backward(
    grad_q: jax.Array,
    grad_k: jax.Array | None,
    cos: jax.Array,
    sin: jax.Array,
    *,
    interleaved: bool = False,
    layout: str = "bhsd",
) -> tuple[jax.Array, jax.Array | None]:
    """Gradients in q and k of apply_rotary for output gradients grad_q, grad_k: the transpose rotation,
    grad * cos - rotate_half(grad * sin) (for tables with equal halves, the rotation by -sin)."""
    r = check_inputs(grad_q, grad_k, cos, sin, interleaved=interleaved, layout=layout)
    return _on_tables(grad_q, grad_k, (), cos, sin, r, interleaved=interleaved, layout=layout, backward=True)


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
) -> tuple[jax.Array, jax.Array | None]:
    """(rope(rms_norm(q) * (weight_offset + q_weight)), the same for k) in one pass: Qwen3 / Gemma 4's q_norm and
    k_norm (RMSNorm over head_dim, per head) followed by RoPE. The norm and rotation are both in f32; the result is
    rounded once. Weights [head_dim] in f32 or bf16."""
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
) -> tuple[jax.Array, jax.Array | None]:
    """apply_rotary with cos/sin computed inside the kernel from integer positions [B or 1, S] (int32), as
    transformers' rotary embedding computes them (f32 angles positions * inv_freq, cos/sin scaled by the rope type's
    attention factor), so no tables cross HBM. theta: the rope base; rotary_dim: rotated features (default head_dim);
    scaling: transformers' rope_parameters dict for "linear", "llama3", "yarn" or "proportional" (Gemma 4), or None.
    The cos/sin stay in f32 (transformers rounds its tables to the model dtype first)."""
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
) -> tuple[jax.Array, jax.Array | None]:
    """Gradients in q and k of apply_rotary_from_positions for output gradients grad_q, grad_k: the transpose
    rotation (by -sin), cos/sin again computed in the kernel."""
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
) -> tuple[jax.Array, jax.Array | None]:
    """rms_norm_rope with cos/sin computed in the kernel from positions (see apply_rotary_from_positions)."""
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
    return reference.cos_sin_from_positions(positions, inv_freq, attention_scaling, interleaved=interleaved)
