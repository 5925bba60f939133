"""The per-chip programs of one decode step, in JAX, for the performance model: each a module-level function (static
configuration bound with functools.partial) and the arguments it is modeled at.

In the expert-parallel layout every chip runs the same replicated attention and dense work over the whole batch and
its own experts over the tokens routed to them; so one chip's step is these programs at the per-chip shapes:

- glue (per layer kind): the input RMSNorm, q/k/v projections, the per-head q/k RMSNorm + RoPE, the output
  projection, the residual add + RMSNorm, the router (logits, softmax, top-k), Gemma 4's dense MLP and its further
  norms. Projections and the router are XLA in every implementation; the norms and RoPE are our kernels in "ours".
- kv write (per layer kind): the new token's K/V into the cache, XLA's scatter in every implementation (transformers'
  static cache writes with index_copy_; our own write kernel models slower than XLA's in-place scatter at decode).
- attention (per layer kind and context): XLA's attention over a static cache [B, Hkv, L, D] (transformers' sdpa
  path: every slot of the cache read, masked by length) or our ragged paged attention kernel over a paged cache.
- experts: experts_forward of the busiest chip (its local experts, every other expert a sentinel) or the default:
  the grouped composition on XLA's ragged dot (what transformers' grouped_mm experts lower to through TorchTPU).
- head (once a step): the final RMSNorm, lm_head, greedy argmax and the next tokens' embedding rows.

The arguments are ShapeDtypeStructs except where a kernel's cost follows values (the routing, the paged attention
metadata): those are concrete, from seeded draws.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax.rms_norm import api as rms_api
from tpu_kernels_jax.rms_norm import reference as rms_reference
from tpu_kernels_jax.rotary import api as rotary_api
from tpu_kernels_jax.rotary import reference as rotary_reference

from .. import shapes
from ..ops import _moe, kv_cache, moe, paged_attention
from .models import CHIPS, PAGE, LayerKind, Model

BF16, F32 = jnp.bfloat16, jnp.float32
EPS = 1e-6
IMPLS = ("default", "ours")  # the two variants of each program; "experts" (ours experts only) mixes them
GEMMA_SOFTCAP = 30.0  # Gemma's final logit soft-capping


def _spec(*shape, dtype=BF16):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)


# ---------------------------------------------------------------------------------------------------------- glue
def norm(impl, x, w):
    if impl == "ours":
        return rms_api.rms_norm(x, w, EPS)
    return rms_reference.rms_norm_reference(x, w, EPS)


def add_norm(impl, x, residual, w):
    if impl == "ours":
        return rms_api.fused_add_rms_norm(x, residual, w, EPS)
    return rms_reference.fused_add_rms_norm_reference(x, residual, w, EPS)


def _qk_norm_rope(impl, q, k, qw, kw, cos, sin):
    """q [B, 1, Hq, D], k [B, 1, Hkv, D] (bshd: the projections' layout, no transpose)."""
    if impl == "ours":
        return rotary_api.rms_norm_rope(q, k, qw, kw, cos, sin, eps=EPS, layout="bshd")
    return rotary_reference.rms_norm_rope_reference(q, k, qw, kw, cos, sin, eps=EPS, layout="bshd")


def _act(x, activation):
    return jax.nn.silu(x) if activation == "silu" else jax.nn.gelu(x, approximate=True)


def attention_in(x, w, cos, sin, *, kind: LayerKind, impl: str):
    """The input RMSNorm, q/k/v projections, per-head q/k RMSNorm + RoPE: q [B, 1, Hq, D], k and v [B, 1, Hkv, D]."""
    b = x.shape[0]
    h = norm(impl, x, w["input_norm"])
    q = (h @ w["wq"]).reshape(b, 1, kind.q_heads, kind.head_dim)
    k = (h @ w["wk"]).reshape(b, 1, kind.kv_heads, kind.head_dim)
    v = k if kind.k_eq_v else (h @ w["wv"]).reshape(b, 1, kind.kv_heads, kind.head_dim)
    q, k = _qk_norm_rope(impl, q, k, w["q_norm"], w["k_norm"], cos, sin)
    return q, k, v


def attention_out(x, attn_out, w, *, model: Model, impl: str):
    """The output projection, residual add + RMSNorm, router (softmax, top-k, renormalised), Gemma 4's dense MLP and
    further norms: (the experts' input, the residual stream out, top-k ids, top-k weights)."""
    o = attn_out @ w["wo"]
    moe_in, residual = add_norm(impl, o, x, w["post_norm"])
    logits = (moe_in @ w["router"]).astype(F32)
    top_w, top_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), model.top_k)
    top_w = top_w / top_w.sum(axis=-1, keepdims=True)
    out = residual
    if model.dense_intermediate:
        d = norm(impl, residual, w["dense_norm"])
        gate, up = jnp.split(d @ w["dense_gate_up"], 2, axis=-1)
        dense = (_act(gate.astype(F32), model.activation) * up).astype(d.dtype) @ w["dense_down"]
        out = out + norm(impl, dense, w["dense_post_norm"])
    for i in range(_extra_norms(model)):
        out = norm(impl, out, w[f"norm{i}"])  # the model's further hidden-size norms (Gemma 4's MoE in/out norms)
    return moe_in, out, top_i, top_w


def _extra_norms(model: Model) -> int:
    return model.norms_per_layer - (4 if model.dense_intermediate else 2)


def glue(x, attn_out, w, cos, sin, *, model: Model, kind: LayerKind, impl: str):
    """One layer's work outside attention and the experts (see the module docstring). x: the residual stream [B, H];
    attn_out: the attention output [B, Hq * D] (an input here: attention is its own program)."""
    q, k, v = attention_in(x, w, cos, sin, kind=kind, impl=impl)
    return (q, k, v, *attention_out(x, attn_out, w, model=model, impl=impl))


def glue_args(model: Model, kind: LayerKind, batch: int):
    hd, q, kv = model.hidden, kind.q_heads * kind.head_dim, kind.kv_heads * kind.head_dim
    w = {
        "input_norm": _spec(hd),
        "wq": _spec(hd, q),
        "wk": _spec(hd, kv),
        "q_norm": _spec(kind.head_dim),
        "k_norm": _spec(kind.head_dim),
        "wo": _spec(q, hd),
        "post_norm": _spec(hd),
        "router": _spec(hd, model.experts),
    }
    if not kind.k_eq_v:
        w["wv"] = _spec(hd, kv)
    if model.dense_intermediate:
        w |= {
            "dense_norm": _spec(hd),
            "dense_post_norm": _spec(hd),
            "dense_gate_up": _spec(hd, 2 * model.dense_intermediate),
            "dense_down": _spec(model.dense_intermediate, hd),
        }
    for i in range(_extra_norms(model)):
        w[f"norm{i}"] = _spec(hd)
    table = _spec(batch, 1, kind.head_dim)
    return _spec(batch, hd), _spec(batch, q), w, table, table


# ----------------------------------------------------------------------------------------------------- kv write
def kv_shape(kind: LayerKind, batch: int) -> shapes.Shape:
    return shapes.Shape(
        "tokens",
        batch,
        (
            ("model", kind.name),
            ("phase", "decode"),
            ("q_heads", kind.q_heads),
            ("kv_heads", kind.kv_heads),
            ("head_dim", kind.head_dim),
        ),
    )


def kv_write(key, value, slots, *, cfg):
    return kv_cache.xla_write(key, value, slots, cfg=cfg)


def kv_write_item(kind: LayerKind, batch: int):
    s = kv_shape(kind, batch)
    return functools.partial(kv_write, cfg=kv_cache.config(s)), kv_cache.write_model_args(s)


# ---------------------------------------------------------------------------------------------------- attention
def paged_shape(kind: LayerKind, batch: int, context: int) -> shapes.Shape:
    return shapes.Shape(
        "batch",
        batch,
        (
            ("model", kind.name),
            ("phase", "decode"),
            ("context", context),
            ("page", PAGE),
            ("q_heads", kind.q_heads),
            ("kv_heads", kind.kv_heads),
            ("head_dim", kind.head_dim),
            ("window", kind.window),
        ),
    )


def static_cache_attention(q, k_cache, v_cache, lengths, *, kind: LayerKind):
    """transformers' sdpa decode over a static cache: q [B, Hq, D], caches [B, Hkv, L, D] (a sliding layer's cache
    holds its window), every slot scored and masked past each sequence's length; f32 softmax."""
    b, hq, d = q.shape
    slots = k_cache.shape[2]
    qg = q.reshape(b, kind.kv_heads, hq // kind.kv_heads, d)
    scale = paged_attention.config(paged_shape(kind, 1, 1)).softmax_scale
    scores = jnp.einsum("bhgd,bhsd->bhgs", qg, k_cache, preferred_element_type=F32) * scale
    keep = jnp.arange(slots, dtype=jnp.int32)[None, :] < jnp.minimum(lengths, slots)[:, None]
    probs = jax.nn.softmax(jnp.where(keep[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgs,bhsd->bhgd", probs.astype(v_cache.dtype), v_cache, preferred_element_type=F32)
    return out.reshape(b, hq * d).astype(q.dtype)


def attention_item(kind: LayerKind, batch: int, context: int, impl: str):
    if impl == "ours":
        s = paged_shape(kind, batch, context)
        fn = functools.partial(paged_attention.kernel_attention, cfg=paged_attention.config(s))
        return fn, paged_attention.model_args(s)
    cache = _spec(batch, kind.kv_heads, kind.keys(context), kind.head_dim)
    lengths = jnp.full((batch,), context, jnp.int32)
    args = (_spec(batch, kind.q_heads, kind.head_dim), cache, cache, lengths)
    return functools.partial(static_cache_attention, kind=kind), args


# ------------------------------------------------------------------------------------------------------ experts
def chip_routing(model: Model, batch: int):
    """(chip, local top_k_index, top_k_weights) of the busiest chip under the seeded random routing (benchmarks/ops/
    _moe.py): the chip whose experts the batch touches most (then: the most rows). Local ids 0 .. E/8 - 1; every other
    chip's expert is the sentinel E/8, which both implementations skip."""
    index, weights = _moe.routing(batch, model.experts, model.top_k)
    local = model.local_experts
    best = None
    for chip in range(CHIPS):
        ids = index.astype(np.int64) - chip * local
        mine = (ids >= 0) & (ids < local)
        load = (len(np.unique(ids[mine])), int(mine.sum()))
        if best is None or load > best[0]:
            best = (load, chip, np.where(mine, ids, local).astype(np.int32))
    return best[1], best[2], weights


def experts_touched(model: Model, batch: int) -> int:
    _, local_index, _ = chip_routing(model, batch)
    return len(np.unique(local_index[local_index < model.local_experts]))


def experts_item(model: Model, batch: int, impl: str, *, one_chip: bool = False):
    """One layer's experts on the busiest chip of the v6e-8 (chip_routing), or with `one_chip` every expert on one
    chip under the same seeded routing."""
    if one_chip:
        (index, weights), e = _moe.routing(batch, model.experts, model.top_k), model.experts
    else:
        (_, index, weights), e = chip_routing(model, batch), model.local_experts
    h, i = model.hidden, model.expert_intermediate
    args = (_spec(batch, h), jnp.asarray(index), jnp.asarray(weights), _spec(e, 2 * i, h), _spec(e, h, i))
    fn = moe.kernel_experts if impl == "ours" else moe.xla_experts
    return functools.partial(fn, activation=model.activation), args


# --------------------------------------------------------------------------------------------------------- head
def logits(x, norm_w, lm_head, *, model: Model, impl: str, capped: bool = True):
    """Final norm, then the logits [B, vocab] in f32 (with `capped`, Gemma's soft-capping)."""
    out = (norm(impl, x, norm_w) @ lm_head.T).astype(F32)
    if capped and model.name.startswith("gemma"):
        out = GEMMA_SOFTCAP * jnp.tanh(out / GEMMA_SOFTCAP)
    return out


def head(x, norm_w, lm_head, embed, *, model: Model, impl: str):
    """Final norm, logits, greedy next tokens, their embedding rows for the next step."""
    tokens = jnp.argmax(logits(x, norm_w, lm_head, model=model, impl=impl), axis=-1)
    return tokens, embed[tokens]


def head_item(model: Model, batch: int, impl: str):
    table = _spec(model.vocab, model.hidden)
    args = (_spec(batch, model.hidden), _spec(model.hidden), table, table)
    return functools.partial(head, model=model, impl=impl), args


def glue_item(model: Model, kind: LayerKind, batch: int, impl: str):
    return functools.partial(glue, model=model, kind=kind, impl=impl), glue_args(model, kind, batch)
