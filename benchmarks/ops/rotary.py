"""Rotary embeddings: RoPE from cos/sin tables, the fused per-head RMSNorm + RoPE, and the fused
RMSNorm + RoPE with cos/sin computed in the kernel from positions, each against the plain-jnp path XLA compiles
(the references: norm then rope, and for positions the tables built by XLA first).

Shapes (benchmarks/shapes.py, ROTARY): transformers' attention layout, q [B, Hq, S, D] and k [B, Hk, S, D] in bf16.
Decode: B sequences of one token, each at its own position (cos/sin [B, 1, D], positions [B, 1]); prefill: one
sequence of S tokens (cos/sin [1, S, D], positions [1, S]). Tables in bf16, as transformers rounds them to the model
dtype; norm weights bf16 [D], eps 1e-6. Rope parameters per model: Qwen3 theta 1e6; Gemma 4 sliding layers theta
1e4; Gemma 4 full layers theta 1e6 with "proportional" partial rotary (factor 0.25: full-width frequencies whose
trailing three quarters are zero), which is why rotary_dim = head_dim there.

Targets, on the modeled v6e figures: >= 85 % of the HBM roofline at >= 64 tokens for every op, and
the fused norm + rope ops >= 1.5x the unfused XLA path at every shape.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax.common import chip
from tpu_kernels_jax.rotary import api, reference, tuning

from .. import inputs, shapes
from ..suite import Baseline, Op, Suite, Targets

EPS = 1e-6
MIN_EFFICIENCY, MIN_EFFICIENCY_FROM = 0.85, 64
MIN_FUSED_SPEEDUP = 1.5
GOAL = (
    f">= {MIN_EFFICIENCY:.0%} of the HBM roofline at >= {MIN_EFFICIENCY_FROM} tokens for every op; the fused norm + "
    f"rope ops >= {MIN_FUSED_SPEEDUP}x the unfused XLA path at every shape"
)
FUSED_OPS = ("rms_norm_rope", "rms_norm_rope_from_positions")

# transformers' rope_parameters of each attention shape (Qwen3-30B-A3B config; Gemma4TextConfig defaults).
ROPE = {
    "qwen3-30b-a3b": {"theta": 1_000_000.0, "scaling": None},
    "gemma4-sliding": {"theta": 10_000.0, "scaling": None},
    "gemma4-full": {"theta": 1_000_000.0, "scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.25}},
}

# `python -m benchmarks` without --full models this subset (keeps `make bench` short; on a CPU the decode shapes up
# to 64 tokens are also timed in interpret mode, ~1 s a call); --full models every shape. Gemma 4 at one token is
# left to --full: launch-bound like Qwen3's.
QUICK_TOKENS = {
    ("qwen3-30b-a3b", "decode"): (1, 64, 256),
    ("qwen3-30b-a3b", "prefill"): (2048,),
    ("gemma4-sliding", "decode"): (64, 256),
    ("gemma4-sliding", "prefill"): (2048,),
}
QUICK = tuple(s for s in shapes.ROTARY if s.batch in QUICK_TOKENS.get((s["model"], s["phase"]), ()))
# `--sweep` without --full: decode at 64 and 256 tokens and one prefill, of Qwen3 (every candidate of every op each)
SWEEP = tuple(s for s in QUICK if s["model"] == "qwen3-30b-a3b" and s.batch in (64, 256, 2048))


# ------------------------------------------------------------------------------------- kernel and default paths
def kernel_apply_rotary(q, k, cos, sin, *, model, blocks=None):
    return api.apply_rotary(q, k, cos, sin, blocks=blocks)


def default_apply_rotary(q, k, cos, sin, *, model):
    return reference.apply_rotary_reference(q, k, cos, sin)


def kernel_rms_norm_rope(q, k, q_weight, k_weight, cos, sin, *, model, blocks=None):
    return api.rms_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=EPS, blocks=blocks)


def default_rms_norm_rope(q, k, q_weight, k_weight, cos, sin, *, model):
    return reference.rms_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps=EPS)


def kernel_rms_norm_rope_from_positions(q, k, q_weight, k_weight, positions, *, model, blocks=None):
    return api.rms_norm_rope_from_positions(q, k, q_weight, k_weight, positions, eps=EPS, blocks=blocks, **ROPE[model])


def default_rms_norm_rope_from_positions(q, k, q_weight, k_weight, positions, *, model):
    """XLA builds the cos/sin tables from the positions (transformers' rotary embedding), then norm and rope."""
    cos, sin = api.rope_cos_sin(positions, head_dim=q.shape[-1], **ROPE[model])
    cos, sin = cos.astype(q.dtype), sin.astype(q.dtype)  # transformers rounds its tables to the model dtype
    return reference.rms_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps=EPS)


# What the chip streams for q and k read and written, measured beside each op: XLA's one elementwise fusion (on the
# v5e, equal read and write bytes stream at 80.1-80.5 % of 819 GB/s in every implementation measured; docs/rms_norm.md)
COPY = "XLA copy of q, k"


def copy_qk(q, k, *tables_or_weights, model):
    """q and k read, arrays of their sizes written: the ops' traffic less their tables, weights or positions."""
    return q * 2, k * 2


# ------------------------------------------------------------------------------------------------ shapes, bytes
def _batch_seq(s):
    """(batch, seq, table batch): decode is B sequences of one token; prefill one sequence of S tokens."""
    return (s["tokens"], 1, s["tokens"]) if s["phase"] == "decode" else (1, s["tokens"], 1)


def _qk(s):
    b, seq, _ = _batch_seq(s)
    dt = jnp.dtype(s.dtype)
    return (
        jax.ShapeDtypeStruct((b, s["q_heads"], seq, s["head_dim"]), dt),
        jax.ShapeDtypeStruct((b, s["kv_heads"], seq, s["head_dim"]), dt),
    )


def _table(s):
    _, seq, tb = _batch_seq(s)
    return jax.ShapeDtypeStruct((tb, seq, s["rotary_dim"]), jnp.dtype(s.dtype))


def _weight(s):
    return jax.ShapeDtypeStruct((s["head_dim"],), jnp.dtype(s.dtype))


def _positions(s):
    _, seq, tb = _batch_seq(s)
    return jax.ShapeDtypeStruct((tb, seq), jnp.int32)


def _nbytes(spec):
    return int(np.prod(spec.shape)) * jnp.dtype(spec.dtype).itemsize


def _qk_bytes(s):
    """q and k read once and written once."""
    return 2 * sum(_nbytes(x) for x in _qk(s))


def _tables_specs(s):
    return (*_qk(s), _table(s), _table(s))


def _norm_specs(s):
    return (*_qk(s), _weight(s), _weight(s), _table(s), _table(s))


def _positions_specs(s):
    return (*_qk(s), _weight(s), _weight(s), _positions(s))


def _positions_arrays(s, seed):
    """Random q, k, weights and nonnegative positions (decode: scattered positions in a 32k context), made on the
    device."""
    q, k, w, _, pos = _positions_specs(s)
    key_q, key_k, key_qw, key_kw, key_pos = inputs.keys(seed, 5)
    if s["phase"] == "decode":
        positions = inputs.integers(key_pos, pos.shape, 0, 32768, jnp.int32)
    else:
        positions = jnp.arange(pos.shape[1], dtype=jnp.int32)[None]
    normal = lambda key, spec: inputs.normal(key, spec.shape, spec.dtype)  # noqa: E731
    return normal(key_q, q), normal(key_k, k), normal(key_qw, w), normal(key_kw, w), positions


def _candidates(op, s, gen):
    """The tuning module's candidate blocks for this op's q, k and tables (or positions) on `gen`."""
    q, k = _qk(s)
    if op == "rms_norm_rope_from_positions":
        arguments = api.tuning_arguments(q, k, _positions(s), scaling=ROPE[s["model"]]["scaling"])
    else:
        arguments = api.tuning_arguments(q, k, (_table(s), _table(s)))
    return tuning.candidate_blocks(**arguments, info=chip.tpu_info_for(gen))


# ------------------------------------------------------------------------------------------------------- targets
def _case(row):
    return row["case"]


def _target(rows, *, name, key, threshold, fmt, limit, gap_unit=""):
    """One target over `rows`: met when the worst row's `key` >= threshold; else how far off and what it would take.
    fmt formats a value of `key`; limit(row) is the modeled kernel time (µs) the row would need."""
    worst = min(rows, key=lambda r: r[key] if r[key] is not None else -1.0)
    value = worst[key]
    ok = value is not None and value >= threshold
    short = [r for r in rows if (r[key] or 0.0) < threshold]
    if value is None:
        detail = "no modeled time"
    elif ok:
        detail = f"{key} {fmt(value)}"
    else:
        detail = (
            f"{key} {fmt(value)}, {fmt(threshold - value)}{gap_unit} short: "
            f"modeled {worst['modeled_kernel']['us']:,.2f} µs "
            f"vs <= {limit(worst):,.2f} µs needed; {len(short)} of {len(rows)} shapes short"
        )
    return {"target": name, "met": ok, "worst": {"case": _case(worst)}, "detail": detail}


def custom_targets(rows: list[dict]) -> list[dict]:
    """>= 85 % of the HBM roofline at >= 64 tokens (every op), and the fused ops >= 1.5x the unfused XLA path."""
    out = []
    sel = [r for r in rows if r["batch"] >= MIN_EFFICIENCY_FROM]
    if sel:
        out.append(
            _target(
                sel,
                name=f"efficiency >= {MIN_EFFICIENCY:.0%} of the HBM roofline at tokens >= {MIN_EFFICIENCY_FROM}",
                key="efficiency",
                threshold=MIN_EFFICIENCY,
                fmt=lambda v: f"{v:.1%}",
                gap_unit=" points",
                limit=lambda r: r["roofline"]["us"] / MIN_EFFICIENCY,
            )
        )
    fused = [r for r in rows if r["op"] in FUSED_OPS]
    if fused:
        out.append(
            _target(
                fused,
                name=f"fused norm + rope >= {MIN_FUSED_SPEEDUP}x the unfused XLA path at every shape",
                key="speedup",
                threshold=MIN_FUSED_SPEEDUP,
                fmt=lambda v: f"{v:.2f}x",
                limit=lambda r: r["modeled_default"]["us"] / MIN_FUSED_SPEEDUP,
            )
        )
    return out


def _static(s):
    return {"model": s["model"]}


SUITE = Suite(
    kernel="rotary",
    ops=(
        Op(
            name="apply_rotary",
            candidates=functools.partial(_candidates, "apply_rotary"),
            kernel=kernel_apply_rotary,
            default=default_apply_rotary,
            specs=_tables_specs,
            hbm_bytes=lambda s: _qk_bytes(s) + 2 * _nbytes(_table(s)),  # + cos and sin read once
            static=_static,
            default_name="XLA (reference rope)",
            baselines=(Baseline(COPY, copy_qk),),
        ),
        Op(
            name="rms_norm_rope",
            candidates=functools.partial(_candidates, "rms_norm_rope"),
            kernel=kernel_rms_norm_rope,
            default=default_rms_norm_rope,
            specs=_norm_specs,
            hbm_bytes=lambda s: _qk_bytes(s) + 2 * _nbytes(_table(s)) + 2 * _nbytes(_weight(s)),
            static=_static,
            default_name="XLA unfused (norm, then rope)",
            baselines=(Baseline(COPY, copy_qk),),
        ),
        Op(
            name="rms_norm_rope_from_positions",
            candidates=functools.partial(_candidates, "rms_norm_rope_from_positions"),
            kernel=kernel_rms_norm_rope_from_positions,
            default=default_rms_norm_rope_from_positions,
            specs=_positions_specs,
            arrays=_positions_arrays,
            hbm_bytes=lambda s: _qk_bytes(s) + _nbytes(_positions(s)) + 2 * _nbytes(_weight(s)),
            static=_static,
            default_name="XLA unfused (tables, norm, then rope)",
            baselines=(Baseline(COPY, copy_qk),),
        ),
    ),
    shapes=shapes.ROTARY,
    quick_shapes=QUICK,
    sweep_shapes=SWEEP,
    targets=Targets(goal=GOAL, custom=custom_targets),
)
