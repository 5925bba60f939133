"""Torch custom ops for rotary embeddings (RoPE, fused per-head RMSNorm + RoPE, both also with cos/sin computed in the
kernel from positions); their gradients come from the JAX api's vjp (_op_registry)."""

import json

import jax
import jax.numpy as jnp
import torch

from tpu_kernels_jax.rotary import api

from . import _torch_checks as checks
from ._op_registry import define_op, static_json


def _f32(x):
    """float16 runs through the kernels as float32 (TPUs have no float16 arithmetic); the result is cast back."""
    return x.astype(jnp.float32) if x.dtype == jnp.float16 else x


# The JAX functions the ops are made from. Annotations drive the torch schema (TorchTPU's jax_op convention). k with
# no heads stands for "no k" (the kernel skips empty arrays); the rope parameters cross as one JSON string, `rope`:
# {"theta": ..., "rotary_dim": ... or null, "scaling": transformers' rope_parameters dict or null}.
def _apply_rotary_jax(
    q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool, layout: str
) -> tuple[jax.Array, jax.Array]:
    out_q, out_k = api.apply_rotary(_f32(q), _f32(k), _f32(cos), _f32(sin), interleaved=interleaved, layout=layout)
    return out_q.astype(q.dtype), out_k.astype(k.dtype)


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
    out_q, out_k = api.rms_norm_rope(
        *(_f32(a) for a in (q, k, q_weight, k_weight, cos, sin)),
        eps=eps,
        weight_offset=weight_offset,
        interleaved=interleaved,
        layout=layout,
    )
    return out_q.astype(q.dtype), out_k.astype(k.dtype)


def _apply_rotary_from_positions_jax(
    q: jax.Array, k: jax.Array, positions: jax.Array, rope: str, interleaved: bool, layout: str
) -> tuple[jax.Array, jax.Array]:
    out_q, out_k = api.apply_rotary_from_positions(
        _f32(q), _f32(k), positions, **json.loads(rope), interleaved=interleaved, layout=layout
    )
    return out_q.astype(q.dtype), out_k.astype(k.dtype)


def _rms_norm_rope_from_positions_jax(
    q: jax.Array,
    k: jax.Array,
    q_weight: jax.Array,
    k_weight: jax.Array,
    positions: jax.Array,
    rope: str,
    eps: float,
    weight_offset: float,
    interleaved: bool,
    layout: str,
) -> tuple[jax.Array, jax.Array]:
    out_q, out_k = api.rms_norm_rope_from_positions(
        *(_f32(a) for a in (q, k, q_weight, k_weight)),
        positions,
        **json.loads(rope),
        eps=eps,
        weight_offset=weight_offset,
        interleaved=interleaved,
        layout=layout,
    )
    return out_q.astype(q.dtype), out_k.astype(k.dtype)


def _fake_pair(a, b, *rest):
    return torch.empty_like(a), torch.empty_like(b)


apply_rotary_op = define_op("apply_rotary", _apply_rotary_jax, _fake_pair, grads=("q", "k", "cos", "sin"))
rms_norm_rope_op = define_op(
    "rms_norm_rope", _rms_norm_rope_jax, _fake_pair, grads=("q", "k", "q_weight", "k_weight", "cos", "sin")
)
apply_rotary_from_positions_op = define_op(
    "apply_rotary_from_positions", _apply_rotary_from_positions_jax, _fake_pair, grads=("q", "k")
)
rms_norm_rope_from_positions_op = define_op(
    "rms_norm_rope_from_positions",
    _rms_norm_rope_from_positions_jax,
    _fake_pair,
    grads=("q", "k", "q_weight", "k_weight"),
)


# ----------------------------------------------------------------------------------------------------- public API
def _placeholders(tensors: dict) -> dict:
    return {name: checks.placeholder(name, t, float16_as_float32=True) for name, t in tensors.items()}


def _validate(q, k, cos, sin, interleaved, layout, weights=None, eps=0.0, weight_offset=0.0):
    checks.check_tensor("q", q)
    for name, t in (("k", k), ("cos", cos), ("sin", sin)) + tuple((weights or {}).items()):
        if t is not None:
            checks.check_tensor(name, t, device=q.device)
    if checks.tracing() or checks.has_symbolic_shape(q, k, cos, sin, *(weights or {}).values()):
        return
    ph = _placeholders({"q": q, "k": k, "cos": cos, "sin": sin, **(weights or {})})
    if weights is None:
        api.check_inputs(ph["q"], ph["k"], ph["cos"], ph["sin"], interleaved=interleaved, layout=layout)
    else:
        api.check_norm_inputs(
            ph["q"],
            ph["k"],
            ph["q_weight"],
            ph["k_weight"],
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
    features rotate, the rest pass through. interleaved: GPT-J pairs (2i, 2i+1). k may be None. q/k float32,
    bfloat16 or float16 (run as float32); results in q's dtype. Differentiable in q, k, cos and sin.
    """
    _validate(q, k, cos, sin, interleaved, layout)
    k_arg = _empty_k(q, layout) if k is None else checks.contiguous(k)
    out_q, out_k = apply_rotary_op(
        checks.contiguous(q), k_arg, checks.contiguous(cos), checks.contiguous(sin), bool(interleaved), layout
    )
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
    tensors = (checks.contiguous(t) for t in (q, k, q_weight, k_weight, cos, sin))
    return rms_norm_rope_op(*tensors, float(eps), float(weight_offset), bool(interleaved), layout)


def _positions_and_rope(q, k, positions, weights, *, theta, rotary_dim, scaling, interleaved, layout):
    """Validate a from-positions call; returns (int32 positions, the rope JSON string)."""
    checks.check_tensor("q", q)
    named = (("k", k), ("positions", positions)) + tuple((weights or {}).items())
    for name, t in named:
        if t is not None:
            checks.check_tensor(name, t, device=q.device)
    positions = checks.as_int32("positions", positions)
    if not checks.tracing() and not checks.has_symbolic_shape(q, k, positions, *(weights or {}).values()):
        # Host positions are range-checked by value; device, fake and meta ones by shape and dtype only (no sync).
        pos = checks.values_or_placeholder("positions", positions)
        ph = _placeholders({"q": q, "k": k, **(weights or {})})
        api.check_position_inputs(
            ph["q"],
            ph["k"],
            pos,
            theta=theta,
            rotary_dim=rotary_dim,
            scaling=scaling,
            interleaved=interleaved,
            layout=layout,
        )
        if weights is not None:
            api.check_norm_weights(ph["q"], ph["k"], ph["q_weight"], ph["k_weight"])
    rope = {"theta": float(theta), "rotary_dim": None if rotary_dim is None else int(rotary_dim), "scaling": scaling}
    return checks.contiguous(positions), static_json("scaling", rope)


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
    """apply_rotary with cos/sin computed inside the kernel from integer positions [B or 1, S] (int32, or int64 such
    as transformers' position_ids, cast once), as transformers' rotary embedding computes them; no cos/sin tensors.
    theta: the rope base (rope_theta); rotary_dim: rotated features (default head_dim); scaling: transformers'
    rope_parameters dict ("linear", "llama3", "yarn", "proportional") or None. Differentiable in q and k."""
    positions, rope = _positions_and_rope(
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
    k_arg = _empty_k(q, layout) if k is None else checks.contiguous(k)
    out_q, out_k = apply_rotary_from_positions_op(
        checks.contiguous(q), k_arg, positions, rope, bool(interleaved), layout
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
    positions, rope = _positions_and_rope(
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
    if not checks.tracing():
        eps, weight_offset = api.check_finite_nonnegative("eps", eps), api.check_finite("weight_offset", weight_offset)
    tensors = (checks.contiguous(t) for t in (q, k, q_weight, k_weight))
    return rms_norm_rope_from_positions_op(
        *tensors, positions, rope, float(eps), float(weight_offset), bool(interleaved), layout
    )
