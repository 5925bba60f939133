"""A whole decode step of a MoE model on one chip, in JAX, measured by device time: `python -m benchmarks.decode
--chip` (or `make decode-tpu`).

One step is: the next tokens' embedding rows, then per decoder layer the input RMSNorm, q/k/v projections, per-head
q/k RMSNorm + RoPE, the new K/V written into the layer's cache, attention over it, the output projection, residual
add + RMSNorm, the router and the experts (programs.py's glue, at the model's real dimensions), then the final norm,
lm_head and the greedy next tokens. The weights are random (nothing can be downloaded on a test chip), and the chip
holds as many layers as fit beside their caches (`fitting_layers`): a whole model's step is then the measured
per-layer time times its layer count, labeled so. A model with layers of several kinds (Gemma 4's five sliding layers
to a full one, gpt-oss's alternating ones) is measured as whole periods of its pattern where one fits; where none
does, each kind's layers are measured alone and the whole step composed from them (`cell_kinds`, `compose_cells`):
scaling a few sliding layers to the model would leave out its full layers, whose cache reads grow with the context.

Three implementations of the same function, on the same weights:

- "default": what a user has without us: XLA's norms and RoPE, the new K/V written into a static cache
  [B, Hkv, L, D] in place and transformers' sdpa attention over every slot of it (masked by length), and the experts
  as transformers' grouped experts lower (XLA's sort + ragged dot, ops/moe.py's xla_experts);
- "ours": our RMSNorm, fused add + RMSNorm and q/k RMSNorm + RoPE kernels, the new K/V written by our cache write
  kernel into a paged cache [pages, page, Hkv, D] and our ragged paged attention over it, our experts_forward;
- "experts": the default with our experts_forward alone (the published comparison's setup).

Both caches hold L = the keys a query sees (a sliding layer's window, else the context and the steps to come), the
new token written at slot position mod L: attention is over a set of keys, so the order a ring buffer leaves them in
does not change it, and each implementation reads exactly the keys the layer attends to.

The greedy tokens are checked teacher-forced: XLA's path decodes freely, and every other implementation is fed XLA's
tokens, so that each of its steps sees the same inputs and one differing token does not derail the rest. Random
weights leave close logits (the top two of a 150,000-token vocabulary are often a rounding apart), so the head returns
each row's top two tokens and logits: a differing token must be the two swapped (compare_tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax import api as tk
from tpu_kernels_jax.common import mxfp4
from tpu_kernels_jax.rotary import api as rotary_api
from tpu_kernels_jax.rotary import reference as rotary_reference

from .. import inputs, profiler
from ..device_timing import reason
from ..ops import moe as moe_ops
from ..ops import paged_attention
from . import programs
from .models import GPT_OSS, MODELS, PAGE, LayerKind, Model

BF16, F32 = jnp.bfloat16, jnp.float32
IMPLS = ("default", "ours", "experts")
# The token check's referee, on request: XLA's path with its weights, caches and activations in f32 (the same
# values: bf16 upcast), teacher-forced like the others; not timed into the table
REFERENCE = "f32"
ROPE_THETA = 1e6
HBM_BANDWIDTH = 819e9  # the v5e's, bytes/s: the step's HBM ceiling
TARGET_BATCH, TARGET_CONTEXT = 64, 4096
TARGETS = {"ours": 2.0, "experts": 1.5}  # the least speedup over XLA's path at the target point
TARGET_CEILING = 0.70  # all ours: the least fraction of the step's HBM ceiling at the target point
# The token check, teacher-forced: the least share of greedy tokens equal to XLA's path's, overall and in every
# sequence. The rest are near ties that rounding decides, and rare larger moves: a router's top-k is discontinuous, so
# a rounding apart can pick another expert (measured on the v5e, Qwen3 at batch 64: 97.3 % equal, 53 of the 59 others
# XLA's top two swapped). A wrong kernel gives unrelated tokens, in every sequence or in the ones it gets wrong.
LEAST_EQUAL_TOKENS = 0.9
LEAST_EQUAL_PER_SEQUENCE = 0.75
DEFAULT_STEPS = 32  # timed steps of a cell, after the warm-up
WARMUP = 2  # steps decoded before the timed ones (compiled, caches and profiler warm)
HBM_BUDGET_BYTES = 11 << 30  # of the v5e's 15.7 GiB: the rest for XLA's temporaries (the default experts path
# relays out a layer's expert weights on every call) and the runtime


CHIP_MODELS = {**MODELS, GPT_OSS.name: GPT_OSS}  # gpt-oss on one chip only (models.GPT_OSS)


def is_gpt_oss(model: Model) -> bool:
    return model.activation == "clamped_swiglu"


def softmax_scale(model: Model, kind: LayerKind) -> float:
    if is_gpt_oss(model):
        return kind.head_dim**-0.5
    return paged_attention.config(programs.paged_shape(kind, 1, 1)).softmax_scale


def glue_impl(impl: str) -> str:
    return "ours" if impl == "ours" else "default"


def _upcast(tree):
    """Every floating array of `tree` in f32 (the f32 referee's weights: the bf16 values, exactly)."""
    return jax.tree.map(lambda a: a.astype(F32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def layer_pattern(model: Model) -> list[LayerKind]:
    """One period of the model's interleaving of its layer kinds (Gemma 4: five sliding layers, then a full one)."""
    unit = math.gcd(*(k.count for k in model.kinds))
    return [k for k in model.kinds for _ in range(k.count // unit)]


def layer_kinds(model: Model, layers: int) -> list[LayerKind]:
    """The model's interleaving of its layer kinds, cut to `layers`."""
    pattern = layer_pattern(model)
    return [pattern[i % len(pattern)] for i in range(layers)]


def kind_view(model: Model, kind: str) -> Model:
    """The model with its layers of one kind only: what a program of those layers alone is fitted and laid out as."""
    chosen = [k for k in model.kinds if k.name == kind]
    if not chosen:
        raise ValueError(f"kind: expected one of {[k.name for k in model.kinds]} ({model.name}'s), got {kind!r}")
    return dataclasses.replace(model, kinds=tuple(chosen))


def represents_model(model: Model, kinds) -> bool:
    """Whether `kinds` hold the model's layer kinds in its proportions, so that their per-layer time scales to it."""
    kinds = list(kinds)
    return bool(kinds) and all(kinds.count(k) * model.layers == k.count * len(kinds) for k in model.kinds)


def cell_kinds(model: Model, batch: int, context: int, steps: int) -> list[str | None]:
    """What one (batch, context) cell measures: [None], one program of whole periods of the layer pattern, where one
    period fits; else every kind's name, each kind's layers measured alone (compose_cells adds them up)."""
    if len(model.kinds) == 1:
        return [None]
    return (
        [None]
        if _layers_that_fit(model, batch, context, steps) >= len(layer_pattern(model))
        else [k.name for k in model.kinds]
    )


def _layers_that_fit(model: Model, batch: int, context: int, steps: int) -> int:
    """fitting_layers, or 0 where not one layer fits."""
    try:
        return fitting_layers(model, batch, context, steps)
    except ValueError:
        return 0


def cache_head_dim(kind: LayerKind, impl: str) -> int:
    """The head dim our paged caches keep: a head dim short of a lane tile (gpt-oss's 64) padded to a whole one, as
    vLLM's TPU kernels pad every head dim but 64. XLA lays a bf16 cache [pages, page, 8, 64] out with another dim than
    the head dim minor (tokens or pages: {1,3,2,0} at pages of 256), which our cache write and attention read and
    write token-major: the compiled step copied both caches of gpt-oss's full layer into that layout and back at every
    step (four copies, 1.19 GB of temporaries at batch 64, compiled for the v5e). Padded to 128, XLA keeps them
    token-major and the kernel reads whole lane tiles; q is padded alike (zeros: the scores are the same) and the
    output cut back."""
    return -(-kind.head_dim // 128) * 128 if impl == "ours" else kind.head_dim


def cache_keys(kind: LayerKind, context: int, steps: int) -> int:
    """L: the cache slots of a layer (whole pages): its window, else the context and the steps to come."""
    keys = kind.keys(context + steps)
    return -(-keys // PAGE) * PAGE if kind.window <= 0 else kind.window


def _layer_weight_bytes(model: Model, kind: LayerKind) -> int:
    return model.dense_bytes_per_layer(kind) + model.experts * model.expert_bytes()


def _embedding_bytes(model: Model) -> int:
    return model.vocab * model.hidden * 2 * (1 if model.tied_embeddings else 2)


def fitting_layers(model: Model, batch: int, context: int, steps: int, budget: int = HBM_BUDGET_BYTES) -> int:
    """The most layers (at least 1, at most the model's) whose weights, the largest implementation's caches and the XLA
    path's copy of each layer's expert weights fit `budget` beside the embeddings: XLA's experts relay the weights
    out on every call, and in a whole step those copies depend on the weights alone, so the compiler may hold every
    layer's at once (Gemma 4's six layers at batch 64 needed 16.4 GB of temporaries, compiled for the v5e). Raises
    ValueError, with the bytes, where not even one layer fits (long contexts at large batches): such a step is not
    compiled."""
    used, layers = _embedding_bytes(model), 0
    for kind in layer_kinds(model, model.layers):
        head_dim = max(cache_head_dim(kind, impl) for impl in IMPLS)  # all ours pads a short head dim
        cache = 2 * batch * cache_keys(kind, context, steps) * kind.kv_heads * head_dim * 2
        used += _layer_weight_bytes(model, kind) + model.experts * model.expert_bytes() + cache
        if is_gpt_oss(model):  # its MXFP4 experts beside the bf16 ones XLA's path multiplies
            used += model.experts * stored_expert_bytes(model)
        if used > budget:
            if not layers:
                raise ValueError(
                    f"does not fit: one layer's weights, the XLA path's copy of its experts and its caches at batch "
                    f"{batch}, context {context} take {used / 1e9:.1f} GB with the embeddings, over the "
                    f"{budget / 1e9:.1f} GB this step may use of the chip's HBM"
                )
            break
        layers += 1
    return layers


def expected_touched(model: Model, batch: int) -> float:
    """Experts a layer's batch touches, expected under uniform top-k routing."""
    return model.experts * (1.0 - (1.0 - model.top_k / model.experts) ** batch)


def stored_expert_bytes(model: Model) -> int:
    """One expert's weights as our path reads them: bf16, or gpt-oss's MXFP4 (half a byte a weight, a byte a 32)."""
    weights = 3 * model.hidden * model.expert_intermediate
    return weights // 2 + weights // mxfp4.BLOCK if is_gpt_oss(model) else model.expert_bytes()


def ceiling_bytes(model: Model, kinds, batch: int, context: int) -> int:
    """The least HBM bytes of a step over `kinds`' layers: each layer's attention, router and dense weights, the
    experts its batch touches (expected under uniform routing, as stored: gpt-oss's MXFP4), the keys and values its
    attention reads; then the head's lm_head (the step's embedding and hidden-state traffic is left out: small
    beside these)."""
    total = model.vocab * model.hidden * 2
    for kind in kinds:
        total += model.dense_bytes_per_layer(kind) + expected_touched(model, batch) * stored_expert_bytes(model)
        total += batch * kind.keys(context) * kind.kv_bytes_per_token
    return int(total)


# ------------------------------------------------------------------------------------------------------ weights
def _random(key, spec, fan_in: int | None, name: str = ""):
    """Random values for a weight: biases and sinks 0.1 N(0, 1), norms 1 + 0.1 N(0, 1), matrices N(0, 1 / fan_in)."""
    if name.startswith("b") or name.endswith("bias") or name == "sinks":
        return inputs.normal(key, spec.shape, spec.dtype, scale=0.1)
    if fan_in is None:
        return (1.0 + inputs.normal(key, spec.shape, F32, scale=0.1)).astype(spec.dtype)
    return inputs.normal(key, spec.shape, spec.dtype, scale=fan_in**-0.5)


def init_params(model: Model, kinds: list[LayerKind], seed: int = 0) -> dict:
    """Random weights on the default device: per layer the glue's (programs.glue_args), the experts' in transformers'
    layout (gate_up [E, 2I, H], down [E, H, I]); the embeddings, the final norm and lm_head (tied where the model
    ties them). One compiled program makes them all: made array by array, every new shape compiled a program of its
    own, and a measurement's weights and inputs took 30-60 s of the v5e host's time. Not gpt-oss's: its MXFP4
    experts' preparation in one program holds 10.9 GB of temporaries beside 6.5 GB of weights (compiled for the v5e),
    more than the chip has, so they are made array by array, as measured there."""
    if is_gpt_oss(model):
        return _make_params(model, tuple(kinds), seed)
    return _make_params_at_once(model, tuple(kinds), seed)


def _make_params(model: Model, kinds: tuple[LayerKind, ...], seed: int) -> dict:
    key = inputs.key(seed)
    layers = []
    for kind in kinds:
        key, sub = jax.random.split(key)
        specs = _gpt_oss_glue_specs(model, kind) if is_gpt_oss(model) else programs.glue_args(model, kind, 1)[2]
        keys = iter(jax.random.split(sub, len(specs) + 4))
        w = {n: _random(next(keys), s, s.shape[0] if len(s.shape) == 2 else None, n) for n, s in specs.items()}
        e, h, i = model.experts, model.hidden, model.expert_intermediate
        if is_gpt_oss(model):
            # a checkpoint's MXFP4 (every e2m1 code; scales 2^-8..2^-6) laid out once as at load, and its bf16
            # dequantization for XLA's path (random bits in the prepared layout would not be a checkpoint's: its
            # scales' padding rows are zero, and the kernel's widening relies on it)
            u8, block = mxfp4.CODE_DTYPE, mxfp4.BLOCK
            checkpoint = (
                inputs.integers(next(keys), (e, 2 * i, h // 2), 0, 256, u8),
                inputs.integers(next(keys), (e, 2 * i, h // block), 119, 122, u8),
                inputs.integers(next(keys), (e, h, i // 2), 0, 256, u8),
                inputs.integers(next(keys), (e, h, i // block), 119, 122, u8),
            )
            gate_up, gate_up_scale, down, down_scale = tk.prepare_mxfp4_experts(*checkpoint)
            w |= {"gate_up_mx": gate_up, "gate_up_scale": gate_up_scale, "down_mx": down, "down_scale": down_scale}
            w["gate_up"] = mxfp4.dequantize_prepared(gate_up, gate_up_scale).astype(BF16)
            w["down"] = mxfp4.dequantize_prepared(down, down_scale).astype(BF16)
        else:
            w["gate_up"] = inputs.normal(next(keys), (e, 2 * i, h), BF16, scale=h**-0.5)
            w["down"] = inputs.normal(next(keys), (e, h, i), BF16, scale=i**-0.5)
        layers.append(w)
    k_embed, k_head, k_norm = jax.random.split(key, 3)
    embed = inputs.normal(k_embed, (model.vocab, model.hidden), BF16)
    lm_head = embed if model.tied_embeddings else inputs.normal(k_head, (model.vocab, model.hidden), BF16)
    final_norm = _random(k_norm, jax.ShapeDtypeStruct((model.hidden,), BF16), None)
    return {"layers": layers, "embed": embed, "lm_head": lm_head, "final_norm": final_norm}


_make_params_at_once = jax.jit(_make_params, static_argnums=(0, 1, 2))


def _gpt_oss_glue_specs(model: Model, kind: LayerKind) -> dict:
    def spec(*shape, dtype=BF16):
        return jax.ShapeDtypeStruct(shape, dtype)

    hd, q, kv = model.hidden, kind.q_heads * kind.head_dim, kind.kv_heads * kind.head_dim
    return {
        "input_norm": spec(hd),
        "wq": spec(hd, q),
        "bq": spec(q),
        "wk": spec(hd, kv),
        "bk": spec(kv),
        "wv": spec(hd, kv),
        "bv": spec(kv),
        "wo": spec(q, hd),
        "bo": spec(hd),
        "post_norm": spec(hd),
        "router": spec(hd, model.experts),
        "router_bias": spec(model.experts),
        "sinks": spec(kind.q_heads, dtype=F32),
    }


def _gpt_oss_attention_in(x, w, cos, sin, *, kind: LayerKind, impl: str):
    """gpt-oss's input RMSNorm, biased q/k/v projections and RoPE (no per-head norm)."""
    b, d = x.shape[0], kind.head_dim
    h = programs.norm(impl, x, w["input_norm"])
    q = (h @ w["wq"] + w["bq"]).reshape(b, 1, kind.q_heads, d)
    k = (h @ w["wk"] + w["bk"]).reshape(b, 1, kind.kv_heads, d)
    v = (h @ w["wv"] + w["bv"]).reshape(b, 1, kind.kv_heads, d)
    rope = rotary_api.apply_rotary if impl == "ours" else rotary_reference.apply_rotary_reference
    q, k = rope(q, k, cos, sin, layout="bshd")
    return q, k, v


def _gpt_oss_attention_out(x, attn_out, w, *, model: Model, impl: str):
    """The biased output projection, residual add + RMSNorm, and the router: softmax over each token's top-k
    logits (gpt-oss's)."""
    o = attn_out @ w["wo"] + w["bo"]
    moe_in, residual = programs.add_norm(impl, o, x, w["post_norm"])
    logits = (moe_in @ w["router"] + w["router_bias"]).astype(F32)
    top_logits, top_i = jax.lax.top_k(logits, model.top_k)
    return moe_in, residual, top_i, jax.nn.softmax(top_logits, axis=-1)


def _static_attention_with_sinks(q, k_cache, v_cache, seen, scale: float, sinks):
    """sdpa over a static cache [B, Hkv, L, D] with gpt-oss's sinks (one logit a head joining each row's softmax)."""
    b, hq, d = q.shape
    hkv, slots = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    scores = jnp.einsum("bhgd,bhsd->bhgs", qg, k_cache, preferred_element_type=F32) * scale
    keep = jnp.arange(slots, dtype=jnp.int32)[None, :] < jnp.minimum(seen, slots)[:, None]
    scores = jnp.where(keep[:, None, None], scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks.reshape(1, hkv, hq // hkv, 1), (b, hkv, hq // hkv, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :slots]
    out = jnp.einsum("bhgs,bhsd->bhgd", probs.astype(v_cache.dtype), v_cache, preferred_element_type=F32)
    return out.reshape(b, hq * d).astype(q.dtype)


# ------------------------------------------------------------------------------------------------------- caches
@dataclasses.dataclass(frozen=True)
class Setup:
    """What one step is traced for (static)."""

    model: Model
    kinds: tuple[LayerKind, ...]
    batch: int
    context: int  # the keys a full layer's first measured step sees (the new token included)
    steps: int  # the steps the caches are sized for
    impl: str


def init_caches(setup: Setup, seed: int = 1) -> list:
    """Per layer, random history, the same keys and values for every implementation (drawn in the static layout, so
    that the implementations' tokens can be compared): "ours" (k_cache, v_cache) [B * L / page, page, Hkv, D] with
    the page table [B, L / page] of sequence b's pages in order; the others (k_cache, v_cache) [B, Hkv, L, D]."""
    keys = iter(jax.random.split(inputs.key(seed), 2 * len(setup.kinds)))
    caches = []
    for kind in setup.kinds:
        slots = cache_keys(kind, setup.context, setup.steps)
        b, h, d = setup.batch, kind.kv_heads, kind.head_dim
        static = tuple(inputs.normal(next(keys), (b, h, slots, d), BF16) for _ in range(2))
        if setup.impl == REFERENCE:
            static = _upcast(static)
        if setup.impl == "ours":
            pad = cache_head_dim(kind, setup.impl) - d
            static = tuple(jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad))) for x in static)
            pages = -(-slots // PAGE)
            table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
            caches.append((*(_paged(x, pages) for x in static), table))
        else:
            caches.append(static)
    return caches


def _paged(static, pages: int):
    """[B, Hkv, L, D] -> [B * pages, page, Hkv, D]: slot s of sequence b at page b * pages + s // page, row
    s % page (the slots past L, up to a whole page, are zeros no query sees)."""
    b, h, slots, d = static.shape
    rows = jnp.pad(static.transpose(0, 2, 1, 3), ((0, 0), (0, pages * PAGE - slots), (0, 0), (0, 0)))
    return rows.reshape(b * pages, PAGE, h, d)


# --------------------------------------------------------------------------------------------------------- step
def _rope_tables(position, batch: int, head_dim: int, dtype=BF16):
    """cos, sin [B, 1, D] at `position` (rotate-half layout, theta ROPE_THETA)."""
    inv = ROPE_THETA ** (-jnp.arange(0, head_dim, 2, dtype=F32) / head_dim)
    angles = position.astype(F32) * inv
    angles = jnp.concatenate([angles, angles])
    table = jnp.broadcast_to(angles, (batch, 1, head_dim))
    return jnp.cos(table).astype(dtype), jnp.sin(table).astype(dtype)


def _attention(setup: Setup, kind: LayerKind, q, k, v, cache, position, sinks=None):
    """The new K/V into the layer's cache at slot position mod L, and attention over the keys it holds (gpt-oss:
    with its sinks): -> (attention output [B, Hq * D], the cache)."""
    slots = cache_keys(kind, setup.context, setup.steps)
    slot = position % slots
    seen = jnp.minimum(position + 1, slots)
    b = setup.batch
    if setup.impl != "ours":
        k_cache, v_cache = cache
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 1, 3), (0, 0, slot, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3), (0, 0, slot, 0))
        lengths = jnp.full((b,), seen, jnp.int32)
        if sinks is None:
            out = programs.static_cache_attention(q[:, 0], k_cache, v_cache, lengths, kind=kind)
        else:
            scale = softmax_scale(setup.model, kind)
            out = _static_attention_with_sinks(q[:, 0], k_cache, v_cache, lengths, scale, sinks)
        return out, (k_cache, v_cache)
    k_cache, v_cache, table = cache
    write_at = table[:, slot // PAGE] * PAGE + slot % PAGE
    pad = ((0, 0), (0, 0), (0, cache_head_dim(kind, setup.impl) - kind.head_dim))  # [B, heads, D]: see cache_head_dim
    k_cache, v_cache = tk.write_kv_cache(k_cache, v_cache, jnp.pad(k[:, 0], pad), jnp.pad(v[:, 0], pad), write_at)
    out = tk.ragged_paged_attention(
        jnp.pad(q[:, 0], pad),
        k_cache,
        v_cache,
        jnp.full((b,), seen, jnp.int32),
        table,
        jnp.arange(b + 1, dtype=jnp.int32),
        jnp.asarray([b], jnp.int32),
        softmax_scale=softmax_scale(setup.model, kind),
        causal=True,
        sinks=sinks,
    )
    return out[..., : kind.head_dim].reshape(b, -1), (k_cache, v_cache, table)


def greedy_head(x, norm_w, lm_head, embed, *, model: Model, impl: str):
    """The head with the token check's evidence: (each row's top two tokens [B, 2] int32 and their logits [B, 2] f32,
    the first's embedding rows): greedy decoding's tokens. Two argmax passes over the logits (the second with the
    first masked): one more read of them than a plain greedy pick, in every implementation alike."""
    # before any soft-capping, which keeps the order (tanh is monotonic) but not in f32: random weights' logits
    # saturate Gemma's cap of 30, where the top tokens tie exactly
    scores = programs.logits(x, norm_w, lm_head, model=model, impl=impl, capped=False)
    first = jnp.argmax(scores, axis=-1)
    columns = jnp.arange(scores.shape[-1], dtype=first.dtype)[None, :]
    second = jnp.argmax(jnp.where(columns == first[:, None], -jnp.inf, scores), axis=-1)
    picks = jnp.stack([first, second], axis=-1).astype(jnp.int32)
    return picks, jnp.take_along_axis(scores, picks, axis=-1), embed[first]


def step(params, caches, embed_rows, position, *, setup: Setup):
    """One decode step: ((top two tokens [B, 2], their logits [B, 2]), the first's embedding rows [B, H], the caches).
    position: int32 scalar, the new token's position in every sequence."""
    model, impl = setup.model, setup.impl
    glue = glue_impl(impl)
    x = embed_rows
    if impl == REFERENCE:
        params, x = _upcast(params), _upcast(x)
    new_caches = []
    gpt_oss = is_gpt_oss(model)
    attention_in = _gpt_oss_attention_in if gpt_oss else programs.attention_in
    attention_out = _gpt_oss_attention_out if gpt_oss else programs.attention_out
    for w, kind, cache in zip(params["layers"], setup.kinds, caches):
        cos, sin = _rope_tables(position, setup.batch, kind.head_dim, x.dtype)
        q, k, v = attention_in(x, w, cos, sin, kind=kind, impl=glue)
        attn, cache = _attention(setup, kind, q, k, v, cache, position, w.get("sinks"))
        new_caches.append(cache)
        moe_in, out, top_i, top_w = attention_out(x, attn, w, model=model, impl=glue)
        if impl in ("default", REFERENCE):
            layout = "interleaved" if gpt_oss else "concatenated"
            y = moe_ops.xla_experts(
                moe_in, top_i, top_w, w["gate_up"], w["down"], activation=model.activation, gate_layout=layout
            )
        elif gpt_oss:
            y = moe_ops.kernel_experts(
                moe_in,
                top_i,
                top_w,
                w["gate_up_mx"],
                w["down_mx"],
                w["gate_up_scale"],
                w["down_scale"],
                activation=model.activation,
                gate_layout="interleaved",
            )
        else:
            y = moe_ops.kernel_experts(moe_in, top_i, top_w, w["gate_up"], w["down"], activation=model.activation)
        x = out + y.astype(x.dtype)
    picks, logits, rows = greedy_head(
        x, params["final_norm"], params["lm_head"], params["embed"], model=model, impl=glue
    )
    return (picks, logits), rows.astype(embed_rows.dtype), new_caches


def compiled_step(setup: Setup, name: str):
    """jit(step) under `name` (the profiler's module name), the caches donated: each step writes them in place."""
    fn = profiler.named(functools.partial(step, setup=setup), name)
    return jax.jit(fn, donate_argnums=(1,))


# ------------------------------------------------------------------------------------------------------ measure
def run_impl(
    setup: Setup,
    params,
    first_tokens,
    *,
    steps: int,
    warmup: int,
    timed: bool,
    name: str,
    head=None,
    forced=None,
) -> dict:
    """Decode warmup + steps steps from first_tokens [B]: each step's top two tokens and logits ("picks" [n, B, 2]
    int32, "logits" [n, B, 2] f32), the host compile seconds, and with `timed` each timed step's device seconds;
    `head` (a HeadProgram) runs in the same profiler trace, after the steps, and its device seconds come back as
    head_s. forced [n - 1, B]: teacher forcing, step i + 1 decodes from forced[i] instead of step i's own token.
    host_s: where the host's time went."""
    caches = init_caches(setup)
    fn = compiled_step(setup, name)
    rows = params["embed"][first_tokens]
    forced_rows = None if forced is None else params["embed"][jnp.asarray(forced)]  # [n - 1, B, H], on the device
    start = time.perf_counter()
    compiled = fn.lower(params, caches, rows, jnp.int32(0)).compile()
    compile_s = time.perf_counter() - start
    tokens = []
    position = setup.context - 1  # the first step's token sees `context` keys in a full layer

    def decode(n):
        nonlocal caches, rows, position
        for _ in range(n):
            out, rows, caches = compiled(params, caches, rows, jnp.int32(position))
            if forced_rows is not None and len(tokens) < len(forced_rows):
                rows = forced_rows[len(tokens)]
            tokens.append(out)
            position += 1
        jax.block_until_ready(rows)

    start = time.perf_counter()
    decode(warmup)
    warm = len(tokens)
    warmup_s = time.perf_counter() - start

    def timed_steps():  # may run twice (profiler.module_times): the tokens are those of the last run
        del tokens[warm:]
        decode(steps)
        if head is not None:
            head.run()

    start = time.perf_counter()
    times = {}
    if timed:
        times = profiler.module_times([name] + ([head.name] if head is not None else []), timed_steps)
    else:
        decode(steps)
    picks, logits = (np.asarray(jnp.stack([t[i] for t in tokens])) for i in (0, 1))
    out = {"picks": picks, "logits": logits, "compile_s": compile_s, "step_s": times.get(name, [])}
    if head is not None:
        out["head_s"] = times.get(head.name, [])
    out["host_s"] = {"compile": compile_s, "warmup": warmup_s, "trace": time.perf_counter() - start}
    return out


@dataclasses.dataclass
class HeadProgram:
    """The step's head alone (final norm, lm_head, greedy tokens, their rows), compiled and warm: what a whole
    model's step counts once, not once a layer. `run()` calls it `calls` times."""

    name: str
    run: object


def head_program(model: Model, impl: str, params, batch: int, *, calls: int, name: str) -> HeadProgram:
    fn = jax.jit(profiler.named(functools.partial(greedy_head, model=model, impl=glue_impl(impl)), name))
    x = inputs.normal(3, (batch, model.hidden), BF16)
    args = (x, params["final_norm"], params["lm_head"], params["embed"])
    jax.block_until_ready(fn(*args))

    def run():
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)

    return HeadProgram(name, run)


def compare_tokens(picks: dict[str, np.ndarray], logits: dict[str, np.ndarray]) -> dict:
    """Each implementation's greedy tokens against the default's, teacher-forced (the same inputs at every step):
    how many are equal; of the others, how many are the default's top two swapped (each the other's runner-up) and
    the widest such gap between the default's top two logits, as a share of its top logit; on the equal tokens, the
    largest relative difference of the top logit (what rounding moved); the fewest equal of one sequence. "ok": at
    least LEAST_EQUAL_TOKENS of them equal, and LEAST_EQUAL_PER_SEQUENCE of every sequence's. Where the f32 referee
    decoded (REFERENCE), how many of each path's tokens and of XLA's equal its; a path at least as near the referee
    as XLA's own is ok whatever it shares with XLA's: their disagreements are rounding's, not a fault of one path."""
    ref, ref_logits = picks["default"], logits["default"]
    exact = picks.get(REFERENCE)
    out = {}
    for impl, p in picks.items():
        if impl in ("default", REFERENCE):
            continue
        equal = p[..., 0] == ref[..., 0]
        swapped = ~equal & (p[..., 0] == ref[..., 1]) & (p[..., 1] == ref[..., 0])
        scale = np.maximum(np.abs(ref_logits[..., 0]), 1e-30)
        gap = (ref_logits[..., 0] - ref_logits[..., 1]) / scale
        drift = np.abs(logits[impl][..., 0] - ref_logits[..., 0]) / scale
        total, same, swaps = int(equal.size), int(equal.sum()), int(swapped.sum())
        worst = int(equal.sum(axis=0).min())  # [steps, B]: the sequence with the fewest equal tokens
        out[impl] = {
            "tokens": total,
            "equal": same,
            "swapped": swaps,
            "widest_swapped_gap": float(gap[swapped].max()) if swaps else None,
            "top_logit_drift_max": float(drift[equal].max()) if same else None,
            "worst_sequence_equal": worst,
            "steps": int(equal.shape[0]),
            "ok": bool(same >= LEAST_EQUAL_TOKENS * total and worst >= LEAST_EQUAL_PER_SEQUENCE * equal.shape[0]),
        }
        if exact is not None:
            mine, xla = (int((q[..., 0] == exact[..., 0]).sum()) for q in (p, ref))
            out[impl] |= {"equal_to_f32": mine, "xla_equal_to_f32": xla, "ok": out[impl]["ok"] or mine >= xla}
    return out


def token_summary(check: dict) -> str:
    """One implementation's token check in a few words."""
    worst = f"worst sequence {check['worst_sequence_equal']}/{check['steps']}"
    text = f"{check['equal']:,}/{check['tokens']:,} equal ({worst})"
    if check["swapped"]:
        text += f", {check['swapped']} top-two swaps (gap <= {check['widest_swapped_gap']:.2%})"
    other = check["tokens"] - check["equal"] - check["swapped"]
    if other:
        text += f", {other} other"
    if "equal_to_f32" in check:
        text += f"; f32 referee's: {check['equal_to_f32']:,} equal (XLA's path {check['xla_equal_to_f32']:,})"
    return text + ("" if check["ok"] else " (FAILS)")


def measure(
    model: Model,
    *,
    batch: int,
    context: int,
    steps: int = 32,
    warmup: int = WARMUP,
    layers: int | None = None,
    impls=IMPLS,
    seed: int = 0,
    kind: str | None = None,
    reference: bool = False,
) -> dict:
    """Each implementation's decode step at (batch, context) on the default device, `layers` layers (default: as
    many whole periods of the layer pattern as fit; with `kind`, as many of that kind's layers alone): median device
    time of `steps` steps after `warmup`, tokens/s, the time a layer ("per_layer_us": the step less the head, over
    the layers), the whole model's step scaled by its layer count where the layers measured hold its kinds in its
    proportions (else compose_cells adds the kinds' measurements up), and the greedy tokens compared. `reference`:
    the f32 referee decodes the same layers too (untimed), and each check says how many tokens each path shares with
    it, so that the check judges the very program measured (at Qwen3's batch 1, context 32768 the cell's 4 layers fit
    beside it on the v5e, measured); where its f32 caches and temporaries do not fit, `layers` takes fewer."""
    start = time.perf_counter()
    view = model if kind is None else kind_view(model, kind)
    if not layers:
        layers = fitting_layers(view, batch, context, warmup + steps)
        if kind is None and len(model.kinds) > 1:
            period = len(layer_pattern(model))
            if layers < period:
                raise ValueError(
                    f"does not fit: {layers} of {model.name}'s layers fit at batch {batch}, context {context}, "
                    f"fewer than one period of its pattern ({period}): measure each kind alone (kind=...)"
                )
            layers -= layers % period
    kinds = tuple(layer_kinds(view, layers))
    params = init_params(model, list(kinds), seed)
    first = inputs.integers(seed + 7, (batch,), 0, model.vocab)
    timed = jax.devices()[0].platform == "tpu"
    results, picks, logits = {}, {}, {}
    init_s = time.perf_counter() - start
    for index, impl in enumerate((*impls, REFERENCE) if reference else impls):
        setup = Setup(model, kinds, batch, context, warmup + steps, impl)
        timing = timed and impl != REFERENCE
        # the head in the step's own profiler trace: one trace per implementation (each took seconds on the v5e host)
        head = None
        if timing:
            head = head_program(model, impl, params, batch, calls=steps, name=profiler.program_name(len(impls) + index))
        name = profiler.program_name(index)
        forced = picks["default"][:-1, :, 0] if "default" in picks else None  # XLA's tokens, teacher forcing
        r = run_impl(
            setup, params, first, steps=steps, warmup=warmup, timed=timing, name=name, head=head, forced=forced
        )
        picks[impl], logits[impl] = r.pop("picks"), r.pop("logits")
        if impl == REFERENCE:
            referee_s = r["host_s"]
            continue
        if r["step_s"]:
            step_us = statistics.median(r["step_s"]) * 1e6
            r |= step_figures(model, kinds, batch, context, step_us, statistics.median(r.pop("head_s")) * 1e6)
        results[impl] = r
    return {
        "model": model.name,
        "batch": batch,
        "context": context,
        "ceiling_us": ceiling_bytes(model, kinds, batch, context) / HBM_BANDWIDTH * 1e6,
        "kind": kind,
        "layers": layers,
        "model_layers": model.layers,
        "steps": steps,
        "device": jax.devices()[0].device_kind,
        "timing": "device time (profiler), median step" if timed else "not timed (no TPU): tokens only",
        "impls": results,
        "tokens": compare_tokens(picks, logits) if "default" in picks else {},
        "host_s": {"weights and inputs": init_s}
        | ({"f32 referee": referee_s} if reference else {})
        | {"total": time.perf_counter() - start},
    }


def step_figures(model: Model, kinds, batch: int, context: int, step_us: float, head_us: float | None) -> dict:
    """What a measured step of `kinds`' layers and the head gives: tokens/s, its share of those layers' HBM ceiling,
    and with the head's time (timed apart) the time a layer (the step less the head, over the layers) and, where the
    layers hold the model's kinds in its proportions, the whole model's step (the layers scaled, the head once)."""
    ceiling_us = ceiling_bytes(model, kinds, batch, context) / HBM_BANDWIDTH * 1e6
    out = {"step_us": step_us, "tokens_per_s": batch / step_us * 1e6, "ceiling_fraction": ceiling_us / step_us}
    if head_us is None:
        return out
    per_layer = (step_us - head_us) / len(kinds)
    out |= {"head_us": head_us, "per_layer_us": per_layer}
    if represents_model(model, kinds):
        whole = head_us + per_layer * model.layers
        out |= {"model_step_us_scaled": whole, "model_tokens_per_s_scaled": batch / whole * 1e6}
    return out


def merge_checks(checks: list[dict]) -> dict:
    """compare_tokens' check of one implementation over several programs of a cell (its kinds' measurements)."""
    swaps = sum(c["swapped"] for c in checks)
    gaps = [c["widest_swapped_gap"] for c in checks if c["widest_swapped_gap"] is not None]
    drifts = [c["top_logit_drift_max"] for c in checks if c["top_logit_drift_max"] is not None]
    merged = {
        "tokens": sum(c["tokens"] for c in checks),
        "equal": sum(c["equal"] for c in checks),
        "swapped": swaps,
        "widest_swapped_gap": max(gaps) if gaps else None,
        "top_logit_drift_max": max(drifts) if drifts else None,
        "worst_sequence_equal": min(c["worst_sequence_equal"] for c in checks),
        "steps": min(c["steps"] for c in checks),
        "ok": all(c["ok"] for c in checks),
    }
    if all("equal_to_f32" in c for c in checks):
        merged |= {k: sum(c[k] for c in checks) for k in ("equal_to_f32", "xla_equal_to_f32")}
    return merged


def results_from_points(points: list[dict]) -> list[dict]:
    """Recorded points (benchmarks/calibration/decode_v5e.json: one per implementation of a measurement) as measure's
    results, for compose_cells and markdown: their token checks are not recorded. A point of whole periods whose head
    was not timed apart takes the head of the same model, batch and implementation at another context (the head does
    not see the context; with none, its step counts no head); a single kind's such point gives no per-layer time (the
    oldest points' head took one argmax, not two: a later head would misstate their layers)."""
    heads = {}
    for p in points:
        if p.get("head_us") is not None:
            heads.setdefault((p["model"], p["batch"], p["impl"]), p["head_us"])
    results: dict[tuple, dict] = {}
    for p in points:
        model = CHIP_MODELS[p["model"]]
        key = (p["model"], p["batch"], p["context"], p.get("kind"), p["layers"])
        r = results.setdefault(
            key,
            {
                "model": p["model"],
                "batch": p["batch"],
                "context": p["context"],
                "kind": p.get("kind"),
                "layers": p["layers"],
                "model_layers": model.layers,
                "steps": p.get("steps", DEFAULT_STEPS),
                "device": p["device_kind"],
                "timing": "device time (profiler), median step",
                "impls": {},
                "tokens": {},
            },
        )
        head = p.get("head_us")
        if head is None and p.get("kind") is None:
            head = heads.get((p["model"], p["batch"], p["impl"]), 0.0)
        kinds = layer_kinds(model if p.get("kind") is None else kind_view(model, p["kind"]), p["layers"])
        r["impls"][p["impl"]] = step_figures(model, kinds, p["batch"], p["context"], p["step_us"], head)
    return list(results.values())


def _composable(result: dict) -> bool:
    """Whether every implementation of a measurement has its per-layer time (its head timed apart)."""
    return all("per_layer_us" in result["impls"].get(impl, {}) for impl in IMPLS)


def compose_cells(results: list[dict]) -> list[dict]:
    """One row per (model, batch, context), in the order first measured. A measurement of whole periods of the layer
    pattern is its own row. A cell's measurements of single kinds are composed: each implementation's whole-model
    step is the head (the median of its measurements') plus every kind's per-layer time times the kind's layer count,
    and its share of the whole model's HBM ceiling. A sliding kind may stand in from another context that also covers
    its window (its caches hold the window whatever the context: the same program), said in the row; with a kind
    unmeasured (it did not fit, or failed) the row keeps the measured programs and gives no whole-model figure. The
    row's "layers" says what was measured."""
    cells: dict[tuple, list[dict]] = {}
    by_kind_anywhere: dict[tuple, list[dict]] = {}
    for r in results:
        cells.setdefault((r["model"], r["batch"], r["context"]), []).append(r)
        if r.get("kind") is not None and _composable(r):
            by_kind_anywhere.setdefault((r["model"], r["batch"], r["kind"]), []).append(r)

    def kind_result(model: Model, kind: LayerKind, batch: int, context: int, measured: list[dict]):
        usable = by_kind_anywhere.get((model.name, batch, kind.name), [])
        own = [r for r in usable if r["context"] == context]
        if own:
            return own[-1]
        if 0 < kind.window <= context:
            covering = [r for r in usable if r["context"] >= kind.window]
            if covering:
                return min(covering, key=lambda r: abs(r["context"] - context))
        mine = [r for r in measured if r.get("kind") == kind.name]
        return mine[-1] if mine else None  # shown, not composable

    rows = []
    for (name, batch, context), measured in cells.items():
        whole = [r for r in measured if r.get("kind") is None]
        if whole:
            r = whole[-1]
            rows.append(r | {"layers_label": f"{r['layers']} of {r['model_layers']}"})
            continue
        model = CHIP_MODELS[name]
        by_kind = {k.name: kind_result(model, k, batch, context, measured) for k in model.kinds}
        present = [k for k in model.kinds if by_kind[k.name] is not None]
        complete = len(present) == len(model.kinds) and all(_composable(by_kind[k.name]) for k in present)
        ceiling_us = ceiling_bytes(model, layer_kinds(model, model.layers), batch, context) / HBM_BANDWIDTH * 1e6
        impls = {}
        for impl in IMPLS:
            parts = [by_kind[k.name]["impls"].get(impl, {}) for k in present]
            m = {"step_label": " / ".join(f"{p['step_us']:,.1f}" for p in parts if "step_us" in p) or None}
            if complete:
                head = statistics.median(p["head_us"] for p in parts)
                step = head + sum(k.count * p["per_layer_us"] for k, p in zip(present, parts))
                m |= {
                    "model_step_us_scaled": step,
                    "model_tokens_per_s_scaled": batch / step * 1e6,
                    "ceiling_fraction": ceiling_us / step,
                }
            impls[impl] = m
        checks = {}
        for impl in IMPLS:
            own = [by_kind[k.name]["tokens"][impl] for k in present if impl in by_kind[k.name].get("tokens", {})]
            if own:
                checks[impl] = merge_checks(own)
        labels = []
        for k in present:
            r = by_kind[k.name]
            labels.append(
                f"{r['layers']} {k.name}" + (f" (at context {r['context']})" if r["context"] != context else "")
            )
        label = " / ".join(labels) + f" of {model.layers}"
        missing = [k for k in model.kinds if by_kind[k.name] is None]
        steps = WARMUP + by_kind[present[0].name].get("steps", DEFAULT_STEPS)
        unfit = [k.name for k in missing if not _layers_that_fit(kind_view(model, k.name), batch, context, steps)]
        unmeasured = [k.name for k in missing if k.name not in unfit]
        if unfit:
            label += f" ({', '.join(unfit)}: one layer does not fit the chip)"
        if unmeasured:
            label += f" (no {', '.join(unmeasured)} measured)"
        if not missing and not complete:
            label += " (a head not timed apart)"
        first = by_kind[present[0].name]
        rows.append(
            {
                "model": name,
                "batch": batch,
                "context": context,
                "kind": "composed",
                "layers_label": label,
                "model_layers": model.layers,
                "ceiling_us": ceiling_us,
                "device": first["device"],
                "timing": first["timing"],
                "impls": impls,
                "tokens": checks,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------------------- cli
# The quick set: one token and the targets' batch. On the v5e host a measurement (three implementations of one
# batch) took about 110 s of host time, most of it compiles and profiler traces, so four batches of one model filled
# most of a 10-minute device command.
BATCHES = (1, 64)
CONTEXTS = (4096,)
FULL_BATCHES, FULL_CONTEXTS = (1, 8, 32, 64, 128, 256), (1024, 4096, 32768)  # 32768 where a layer fits
NAMES = {"default": "XLA (transformers' default)", "ours": "all ours", "experts": "our experts_forward only"}


def markdown(rows: list[dict]) -> list[str]:
    """One table row per compose_cells row: each implementation's measured step(s) and whole-model tokens/s (scaled
    from the measured layers), our speedups, the share of the HBM ceiling and whether the greedy tokens agreed. A
    composed row gives its kinds' steps in the order of "layers measured" and the whole model's ceiling."""
    head = ["model", "batch", "context", "layers measured"]
    for impl in IMPLS:
        head += [f"{NAMES[impl]} µs/step", f"{NAMES[impl]} tokens/s (whole model, scaled)"]
    head += ["all ours vs XLA", "experts only vs XLA", "all ours % of HBM ceiling", "greedy tokens vs XLA's, forced"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        label = r.get("layers_label") or f"{r['layers']} of {r['model_layers']}"
        cells = [r["model"], str(r["batch"]), str(r["context"]), label]
        impls = r["impls"]
        for impl in IMPLS:
            m = impls.get(impl, {})
            step = m.get("step_label") or (f"{m['step_us']:,.1f}" if "step_us" in m else None)
            scaled = m.get("model_tokens_per_s_scaled")
            cells += [step or "—", "—" if scaled is None else f"{scaled:,.0f}"]
        for impl in ("ours", "experts"):
            a, b = impls.get("default", {}), impls.get(impl, {})
            ok = "model_step_us_scaled" in a and "model_step_us_scaled" in b
            cells.append(f"{a['model_step_us_scaled'] / b['model_step_us_scaled']:.2f}x" if ok else "—")
        fraction = impls.get("ours", {}).get("ceiling_fraction")
        cells.append("—" if fraction is None else f"{fraction:.1%}")
        agree = r["tokens"]
        cells.append("; ".join(f"{NAMES[i]}: {token_summary(v)}" for i, v in agree.items()))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def chart(results: list[dict], path) -> bool:
    """Whole-model tokens/s against batch, one panel per (model, context), a line per implementation (log scales);
    False where matplotlib is not installed (a TPU host used as it is)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = sorted({(r["model"], r["context"]) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (model, context) in zip(axes[0], panels):
        rows = sorted((r for r in results if (r["model"], r["context"]) == (model, context)), key=lambda r: r["batch"])
        for impl in IMPLS:
            points = [
                (r["batch"], r["impls"][impl]["model_tokens_per_s_scaled"])
                for r in rows
                if "model_tokens_per_s_scaled" in r["impls"].get(impl, {})
            ]
            if points:
                ax.plot(*zip(*points), marker="o", label=NAMES[impl])
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s (whole model, scaled)")
        ax.set_title(f"{model}, context {context}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def target_lines(results: list[dict]) -> list[str]:
    """The targets at batch TARGET_BATCH, context TARGET_CONTEXT, per model: met, or the measured gap."""
    lines = []
    for r in results:
        if (r["batch"], r["context"]) != (TARGET_BATCH, TARGET_CONTEXT) or any(
            "model_step_us_scaled" not in r["impls"].get(impl, {}) for impl in IMPLS
        ):
            continue
        xla = r["impls"]["default"]["model_step_us_scaled"]
        for impl, least in TARGETS.items():
            got = xla / r["impls"][impl]["model_step_us_scaled"]
            state = "met" if got >= least else "NOT MET"
            lines.append(f"target, {r['model']}: {NAMES[impl]} >= {least}x XLA's tokens/s: {state} ({got:.2f}x)")
        fraction = r["impls"]["ours"]["ceiling_fraction"]
        state = "met" if fraction >= TARGET_CEILING else "NOT MET"
        lines.append(
            f"target, {r['model']}: all ours >= {TARGET_CEILING:.0%} of the step's HBM ceiling: {state} "
            f"({fraction:.1%})"
        )
    for r in results:
        for impl, check in r.get("tokens", {}).items():
            state = "agree" if check["ok"] else "DO NOT AGREE"
            lines.append(
                f"tokens, {r['model']} batch {r['batch']}: {NAMES[impl]} and XLA's path {state} "
                f"({token_summary(check)})"
            )
    return lines


def detail(e: BaseException, chars: int = 4000) -> str:
    """Where a failed measurement stopped (the traceback's frames in this project's code) and the error's whole
    message, cut to `chars`: XLA's and Mosaic's errors name the program and the allocation on later lines."""
    frames = [
        f for f in traceback.extract_tb(e.__traceback__) if "/benchmarks/" in f.filename or "/kernels/" in f.filename
    ]
    where = " <- ".join(f"{pathlib.Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-6:]))
    return f"{type(e).__name__} at {where}: {str(e)[:chars]}"


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m benchmarks.decode.chip_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", choices=sorted(CHIP_MODELS), help="repeatable (default: every model)")
    p.add_argument("--batch", action="append", type=int, help=f"repeatable (default: {BATCHES}; --full {FULL_BATCHES})")
    p.add_argument(
        "--context", action="append", type=int, help=f"repeatable (default: {CONTEXTS}; --full {FULL_CONTEXTS})"
    )
    p.add_argument("--full", action="store_true", help="every batch and context of the full table")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed steps (the median is reported)")
    p.add_argument("--layers", type=int, default=None, help="layers on the chip (default: as many as fit)")
    p.add_argument(
        "--f32-reference",
        action="store_true",
        help="also decode XLA's path in f32 (untimed, the same layers) and check every path's tokens against it",
    )
    p.add_argument("--kind", default=None, help="measure only this layer kind's layers (default: cell_kinds' plan)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results"))
    p.add_argument("--table-from", type=pathlib.Path, default=None, help="the table of recorded points (no measuring)")
    args = p.parse_args(argv)
    if args.table_from:
        rows = compose_cells(results_from_points(json.loads(args.table_from.read_text())["points"]))
        rows.sort(key=lambda r: (r["model"], r["context"], r["batch"]))
        print("\n".join([*markdown(rows), "", *target_lines(rows)]))
        return 0
    results, failures = [], []
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.model or sorted(CHIP_MODELS):
        for context in args.context or (FULL_CONTEXTS if args.full else CONTEXTS):
            for batch in args.batch or (FULL_BATCHES if args.full else BATCHES):
                model = CHIP_MODELS[name]
                kinds = [args.kind] if args.kind else cell_kinds(model, batch, context, WARMUP + args.steps)
                for kind in kinds:
                    where = f"{name} batch {batch} context {context}" + (f" ({kind} layers)" if kind else "")
                    try:
                        r = measure(
                            model,
                            batch=batch,
                            context=context,
                            steps=args.steps,
                            layers=args.layers,
                            kind=kind,
                            reference=args.f32_reference,
                        )
                    except Exception as e:  # noqa: BLE001 - one step that does not fit or compile must not lose the rest
                        failures.append(
                            {"model": name, "batch": batch, "context": context, "kind": kind}
                            | {"error": reason(e), "detail": detail(e)}
                        )
                        print(f"{where}: {failures[-1]['detail']}", flush=True)
                    else:
                        results.append(r)
                        print(where, "\n".join(markdown([r])[2:]), f"(host {r['host_s']['total']:.0f} s)", flush=True)
                    # written after every step measured: a run stopped midway keeps what it measured
                    (args.out / "decode_chip.json").write_text(
                        json.dumps({"steps": results, "failed": failures}, indent=1, default=str)
                    )
    rows = compose_cells(results)
    timing = results[0]["timing"] if results else ""
    label = f"measured {results[0]['device']}, {timing}" if results else ""
    text = [f"Decode step on one chip ({label}); whole-model figures scale the measured layers, the head once", ""]
    text += markdown(rows)
    text += [
        f"failed: {f['model']} at batch {f['batch']}, context {f['context']}"
        + (f" ({f['kind']} layers)" if f.get("kind") else "")
        + f": {f['error']}"
        for f in failures
    ]
    text += ["", *target_lines(rows)]
    text += [
        "",
        f"HBM ceiling: the measured layers' weights, the experts a batch touches (expected under uniform routing), the "
        f"keys and values read, and lm_head, at {HBM_BANDWIDTH / 1e9:.0f} GB/s (the v5e's); of the whole model where "
        f"the row composes its kinds' measurements (their steps given in the order of its layers).",
    ]
    (args.out / "decode_chip.md").write_text("\n".join(text) + "\n")
    if any("model_tokens_per_s_scaled" in m for r in rows for m in r["impls"].values()):
        chart(rows, args.out / "decode_chip.png")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
