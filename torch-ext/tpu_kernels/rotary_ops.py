"""Torch custom ops for rotary embeddings (RoPE, its backward, fused per-head RMSNorm + RoPE, both with cos/sin computed
in the kernel from positions) and their autograd."""

import jax
import torch

from tpu_kernels_jax.rotary import api

from . import _torch_checks as checks
from ._op_registry import define_op
from .rms_norm_ops import rms_norm_backward_op


# The JAX functions the ops are made from. Annotations drive the torch schema (TorchTPU's jax_op convention).
def _apply_rotary_jax(
    q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool, layout: str
) -> tuple[jax.Array, jax.Array]:
    return api.apply_rotary(q, k, cos, sin, interleaved=interleaved, layout=layout)


def _apply_rotary_backward_jax(
    grad_q: jax.Array, grad_k: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool, layout: str
) -> tuple[jax.Array, jax.Array]:
    return api.apply_rotary_backward(grad_q, grad_k, cos, sin, interleaved=interleaved, layout=layout)


def _rms_norm_rope_jax(
    q: jax.Array,
    k: jax.Array,
    q_weight: jax.Array,
    k_weight: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    eps: float,
    weight_offset: float,
    interleaved: bool,
    layout: str,
) -> tuple[jax.Array, jax.Array]:
    return api.rms_norm_rope(
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


# Rope scaling as scalars: a torch schema cannot take transformers' rope_parameters dict, so the ops take its entries
# (the rope type, then every number any type uses, 0.0 / 0 for "not given": every such number must be > 0 when
# given) and rebuild the dict. rotary_dim 0 stands for None (head_dim).
SCALING_NUMBERS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "partial_rotary_factor",
)


def scaling_to_scalars(scaling) -> tuple:
    """(rope_type, *SCALING_NUMBERS as floats, truncate) of a validated rope_parameters dict or None."""
    scaling = api.frequencies.check_scaling(scaling)
    numbers = tuple(0.0 if scaling.get(key) is None else float(scaling[key]) for key in SCALING_NUMBERS)
    return (scaling["rope_type"], *numbers, bool(scaling.get("truncate", True)))


def scaling_from_scalars(rope_type, numbers, truncate):
    """The rope_parameters dict (None for the default rope) the scalars stand for."""
    if rope_type == "default":
        return None
    keys = api.frequencies.ROPE_KEYS[rope_type]
    scaling = {"rope_type": rope_type}
    scaling.update({key: value for key, value in zip(SCALING_NUMBERS, numbers) if value and key in keys})
    if "original_max_position_embeddings" in scaling:
        scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    if "truncate" in keys and not truncate:
        scaling["truncate"] = False
    return scaling


def _positions_kw(args: dict) -> dict:
    """The api's keyword arguments from an op's scalar arguments (its locals())."""
    numbers = [args[key] for key in SCALING_NUMBERS]
    return dict(
        theta=args["theta"],
        rotary_dim=args["rotary_dim"] or None,
        scaling=scaling_from_scalars(args["rope_type"], numbers, args["truncate"]),
        interleaved=args["interleaved"],
        layout=args["layout"],
    )


def _apply_rotary_from_positions_jax(
    q: jax.Array,
    k: jax.Array,
    positions: jax.Array,
    theta: float,
    rotary_dim: int,
    rope_type: str,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: float,
    attention_factor: float,
    beta_fast: float,
    beta_slow: float,
    mscale: float,
    mscale_all_dim: float,
    partial_rotary_factor: float,
    truncate: bool,
    interleaved: bool,
    layout: str,
) -> tuple[jax.Array, jax.Array]:
    return api.apply_rotary_from_positions(q, k, positions, **_positions_kw(locals()))


def _apply_rotary_from_positions_backward_jax(
    grad_q: jax.Array,
    grad_k: jax.Array,
    positions: jax.Array,
    theta: float,
    rotary_dim: int,
    rope_type: str,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: float,
    attention_factor: float,
    beta_fast: float,
    beta_slow: float,
    mscale: float,
    mscale_all_dim: float,
    partial_rotary_factor: float,
    truncate: bool,
    interleaved: bool,
    layout: str,
) -> tuple[jax.Array, jax.Array]:
    return api.apply_rotary_from_positions_backward(grad_q, grad_k, positions, **_positions_kw(locals()))


def _rms_norm_rope_from_positions_jax(
    q: jax.Array,
    k: jax.Array,
    q_weight: jax.Array,
    k_weight: jax.Array,
    positions: jax.Array,
    theta: float,
    eps: float,
    weight_offset: float,
    rotary_dim: int,
    rope_type: str,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: float,
    attention_factor: float,
    beta_fast: float,
    beta_slow: float,
    mscale: float,
    mscale_all_dim: float,
    partial_rotary_factor: float,
    truncate: bool,
    interleaved: bool,
    layout: str,
) -> tuple[jax.Array, jax.Array]:
    return api.rms_norm_rope_from_positions(
        q, k, q_weight, k_weight, positions, eps=eps, weight_offset=weight_offset, **_positions_kw(locals())
    )


def _fake_pair(a, b, *rest):
    return torch.empty_like(a), torch.empty_like(b)


apply_rotary_op = define_op("apply_rotary", _apply_rotary_jax, _fake_pair)
apply_rotary_backward_op = define_op("apply_rotary_backward", _apply_rotary_backward_jax, _fake_pair)
rms_norm_rope_op = define_op("rms_norm_rope", _rms_norm_rope_jax, _fake_pair)
apply_rotary_from_positions_op = define_op("apply_rotary_from_positions", _apply_rotary_from_positions_jax, _fake_pair)
apply_rotary_from_positions_backward_op = define_op(
    "apply_rotary_from_positions_backward", _apply_rotary_from_positions_backward_jax, _fake_pair
)
rms_norm_rope_from_positions_op = define_op(
    "rms_norm_rope_from_positions", _rms_norm_rope_from_positions_jax, _fake_pair
)


# ------------------------------------------------------------------------------------------------------- autograd
def _rotate_half(x, interleaved):
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _table_grads(ctx, xs, grads, cos, sin):
    """d cos, d sin of out = x * cos + rotate_half(x) * sin (plain torch: sums over heads, and over the batch when
    the table is shared). xs are what the rotation saw (the normalised q/k for the fused op)."""
    head_axis = 1 if ctx.layout == "bhsd" else 2
    r = cos.shape[-1]
    need_cos, need_sin = ctx.needs_input_grad[ctx.cos_index], ctx.needs_input_grad[ctx.cos_index + 1]
    dcos = dsin = None
    for x, g in zip(xs, grads):
        xr, gr = x[..., :r].float(), g[..., :r].float()
        if need_cos:
            part = (gr * xr).sum(head_axis)
            dcos = part if dcos is None else dcos + part
        if need_sin:
            part = (gr * _rotate_half(xr, ctx.interleaved)).sum(head_axis)
            dsin = part if dsin is None else dsin + part
    if cos.shape[0] == 1:
        dcos = None if dcos is None else dcos.sum(0, keepdim=True)
        dsin = None if dsin is None else dsin.sum(0, keepdim=True)
    return (None if dcos is None else dcos.to(cos.dtype)), (None if dsin is None else dsin.to(sin.dtype))


def _setup_rotary(ctx, inputs, output):
    q, k, cos, sin, interleaved, layout = inputs
    ctx.interleaved, ctx.layout, ctx.cos_index = interleaved, layout, 2
    ctx.save_for_backward(q, k, cos, sin)


def _backward_rotary(ctx, grad_q, grad_k):
    q, k, cos, sin = ctx.saved_tensors
    dq, dk = apply_rotary_backward_op(grad_q.contiguous(), grad_k.contiguous(), cos, sin, ctx.interleaved, ctx.layout)
    dcos, dsin = _table_grads(ctx, (q, k), (grad_q, grad_k), cos, sin)
    return dq, dk, dcos, dsin, None, None


def _setup_norm_rope(ctx, inputs, output):
    q, k, q_weight, k_weight, cos, sin, eps, weight_offset, interleaved, layout = inputs
    ctx.interleaved, ctx.layout, ctx.cos_index = interleaved, layout, 4
    ctx.eps, ctx.weight_offset = eps, weight_offset
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)


def _head_rms_norm(x, weight, eps, weight_offset):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight_offset + weight.float())


def _backward_norm_rope(ctx, grad_q, grad_k):
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    g_q, g_k = apply_rotary_backward_op(grad_q.contiguous(), grad_k.contiguous(), cos, sin, ctx.interleaved, ctx.layout)
    dq, dqw = rms_norm_backward_op(g_q, q, q_weight, None, ctx.eps, ctx.weight_offset)
    dk, dkw = rms_norm_backward_op(g_k, k, k_weight, None, ctx.eps, ctx.weight_offset)
    dcos = dsin = None
    if ctx.needs_input_grad[4] or ctx.needs_input_grad[5]:
        normed = (
            _head_rms_norm(q, q_weight, ctx.eps, ctx.weight_offset),
            _head_rms_norm(k, k_weight, ctx.eps, ctx.weight_offset),
        )
        dcos, dsin = _table_grads(ctx, normed, (grad_q, grad_k), cos, sin)
    return dq, dk, dqw, dkw, dcos, dsin, None, None, None, None


# Positions ops: the scalars after the tensors are kept as they came and passed to the backward op unchanged.


def _setup_rotary_from_positions(ctx, inputs, output):
    q, k, positions = inputs[:3]
    ctx.rope_args = tuple(inputs[3:])  # the rope scalars, interleaved, layout
    ctx.save_for_backward(positions)


def _backward_rotary_from_positions(ctx, grad_q, grad_k):
    (positions,) = ctx.saved_tensors
    dq, dk = apply_rotary_from_positions_backward_op(
        grad_q.contiguous(), grad_k.contiguous(), positions, *ctx.rope_args
    )
    return (dq, dk, None) + (None,) * len(ctx.rope_args)


def _setup_norm_rope_from_positions(ctx, inputs, output):
    q, k, q_weight, k_weight, positions, theta, eps, weight_offset = inputs[:8]
    ctx.eps, ctx.weight_offset = eps, weight_offset
    ctx.rope_args = (theta,) + tuple(inputs[8:])  # theta, the other rope scalars, interleaved, layout
    ctx.save_for_backward(q, k, q_weight, k_weight, positions)


def _backward_norm_rope_from_positions(ctx, grad_q, grad_k):
    q, k, q_weight, k_weight, positions = ctx.saved_tensors
    g_q, g_k = apply_rotary_from_positions_backward_op(
        grad_q.contiguous(), grad_k.contiguous(), positions, *ctx.rope_args
    )
    dq, dqw = rms_norm_backward_op(g_q, q, q_weight, None, ctx.eps, ctx.weight_offset)
    dk, dkw = rms_norm_backward_op(g_k, k, k_weight, None, ctx.eps, ctx.weight_offset)
    return (dq, dk, dqw, dkw, None) + (None,) * (2 + len(ctx.rope_args))


apply_rotary_op.register_autograd(_backward_rotary, setup_context=_setup_rotary)
rms_norm_rope_op.register_autograd(_backward_norm_rope, setup_context=_setup_norm_rope)
apply_rotary_from_positions_op.register_autograd(
    _backward_rotary_from_positions, setup_context=_setup_rotary_from_positions
)
rms_norm_rope_from_positions_op.register_autograd(
    _backward_norm_rope_from_positions, setup_context=_setup_norm_rope_from_positions
)


# ----------------------------------------------------------------------------------------------------- public API
def _validate(q, k, cos, sin, interleaved, layout, weights=None, eps=0.0, weight_offset=0.0):
    checks.check_tensor("q", q)
    for name, t in (("k", k), ("cos", cos), ("sin", sin)) + tuple((weights or {}).items()):
        if t is not None:
            checks.check_tensor(name, t, device=q.device)
    if checks.has_symbolic_shape(q, k, cos, sin, *(weights or {}).values()):
        return
    ph = {name: checks.placeholder(name, t) for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin))}
    if weights is None:
        api.check_inputs(ph["q"], ph["k"], ph["cos"], ph["sin"], interleaved=interleaved, layout=layout)
    else:
        wph = {name: checks.placeholder(name, t) for name, t in weights.items()}
        api.check_norm_inputs(
            ph["q"],
            ph["k"],
            wph["q_weight"],
            wph["k_weight"],
            ph["cos"],
            ph["sin"],
            eps=eps,
            weight_offset=weight_offset,
            interleaved=interleaved,
            layout=layout,
        )


def _empty_k(q, layout):
    """k with no heads stands for 'no k' in the ops (the kernel skips empty arrays)."""
    shape = (q.shape[0], 0, q.shape[2], q.shape[3]) if layout == "bhsd" else (q.shape[0], q.shape[1], 0, q.shape[3])
    return q.new_empty(shape)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    layout: str = "bhsd",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q * cos + rotate_half(q) * sin, the same for k) in one pass: transformers' apply_rotary_pos_emb.

    layout "bhsd": q [B, Hq, S, D], k [B, Hk, S, D]; "bshd": [B, S, H, D]. cos/sin [B or 1, S, r]: the first r
    features rotate, the rest pass through. interleaved: GPT-J pairs (2i, 2i+1). k may be None. q/k float32 or
    bfloat16; results in q's dtype. Differentiable in q, k, cos and sin.
    """
    _validate(q, k, cos, sin, interleaved, layout)
    k_arg = _empty_k(q, layout) if k is None else k.contiguous()
    out_q, out_k = apply_rotary_op(q.contiguous(), k_arg, cos.contiguous(), sin.contiguous(), bool(interleaved), layout)
    return out_q, (None if k is None else out_k)


def rms_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    interleaved: bool = False,
    layout: str = "bhsd",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(rms_norm(q) * (weight_offset + q_weight)), the same for k) in one pass: Qwen3 / Gemma 4's q_norm and
    k_norm over head_dim followed by RoPE. Differentiable in q, k, the weights, cos and sin."""
    _validate(q, k, cos, sin, interleaved, layout, {"q_weight": q_weight, "k_weight": k_weight}, eps, weight_offset)
    return rms_norm_rope_op(
        q.contiguous(),
        k.contiguous(),
        q_weight,
        k_weight,
        cos.contiguous(),
        sin.contiguous(),
        float(eps),
        float(weight_offset),
        bool(interleaved),
        layout,
    )


def _validate_positions(q, k, positions, weights, *, theta, rotary_dim, scaling, interleaved, layout):
    checks.check_tensor("q", q)
    named = (("k", k), ("positions", positions)) + tuple((weights or {}).items())
    for name, t in named:
        if t is not None:
            checks.check_tensor(name, t, device=q.device)
    if checks.has_symbolic_shape(q, k, positions, *(weights or {}).values()):
        return
    # Host positions are range-checked by value; device, fake and meta ones by shape and dtype only (no sync).
    pos = checks.values_or_placeholder("positions", positions)
    ph_q, ph_k = checks.placeholder("q", q), checks.placeholder("k", k)
    api.check_position_inputs(
        ph_q, ph_k, pos, theta=theta, rotary_dim=rotary_dim, scaling=scaling, interleaved=interleaved, layout=layout
    )
    if weights is not None:
        wph = {name: checks.placeholder(name, t) for name, t in weights.items()}
        api.check_norm_weights(ph_q, ph_k, wph["q_weight"], wph["k_weight"])


def _rope_scalars(theta, rotary_dim, scaling):
    return (float(theta), int(rotary_dim or 0), *scaling_to_scalars(scaling))


def apply_rotary_from_positions(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    *,
    theta: float,
    rotary_dim: int | None = None,
    scaling: dict | None = None,
    interleaved: bool = False,
    layout: str = "bhsd",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """apply_rotary with cos/sin computed inside the kernel from int32 positions [B or 1, S], as transformers'
    rotary embedding computes them; no cos/sin tensors. theta: the rope base (rope_theta); rotary_dim: rotated
    features (default head_dim); scaling: transformers' rope_parameters dict ("linear", "llama3", "yarn",
    "proportional") or None. Differentiable in q and k."""
    _validate_positions(
        q,
        k,
        positions,
        None,
        theta=theta,
        rotary_dim=rotary_dim,
        scaling=scaling,
        interleaved=interleaved,
        layout=layout,
    )
    k_arg = _empty_k(q, layout) if k is None else k.contiguous()
    out_q, out_k = apply_rotary_from_positions_op(
        q.contiguous(),
        k_arg,
        positions.contiguous(),
        *_rope_scalars(theta, rotary_dim, scaling),
        bool(interleaved),
        layout,
    )
    return out_q, (None if k is None else out_k)


def rms_norm_rope_from_positions(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    *,
    theta: float,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    rotary_dim: int | None = None,
    scaling: dict | None = None,
    interleaved: bool = False,
    layout: str = "bhsd",
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_rope with cos/sin computed in the kernel from positions (see apply_rotary_from_positions).
    Differentiable in q, k and the weights."""
    _validate_positions(
        q,
        k,
        positions,
        {"q_weight": q_weight, "k_weight": k_weight},
        theta=theta,
        rotary_dim=rotary_dim,
        scaling=scaling,
        interleaved=interleaved,
        layout=layout,
    )
    theta_, rotary_dim_, *rest = _rope_scalars(theta, rotary_dim, scaling)
    return rms_norm_rope_from_positions_op(
        q.contiguous(),
        k.contiguous(),
        q_weight,
        k_weight,
        positions.contiguous(),
        theta_,
        float(api.check_finite_nonnegative("eps", eps)),
        float(api.check_finite("weight_offset", weight_offset)),
        rotary_dim_,
        *rest,
        bool(interleaved),
        layout,
    )
