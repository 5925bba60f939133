"""The activations and gatings the kernels' epilogues apply (ragged dot's fused epilogue, the MoE small-batch kernel),
written once for the Pallas kernel bodies and the XLA epilogue of the unfused paths, so every path computes the same
function.

An activation is None, "silu", "gelu" (exact, erf: transformers' "gelu", the default `hidden_act` of many MoE
configs), "gelu_tanh", "relu2" (ReLU squared, Nemotron-H's experts; gated: act(gate) * up) or a
`ClampedSwiGLU` (gpt-oss's gating, which needs a gate: it acts on gate and up together). Each reference writes its
own (plain `jax.nn`); tests/test_ragged_dot.py ties the two together for every activation.
"""

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu2")

_SQRT_2_OVER_PI = 0.7978845608028654
_SQRT_HALF = 0.7071067811865476


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gating of the gate/up projection (hashable: a static argument of the kernels):

        gate = min(gate, limit);  up = clip(up, -limit, limit)
        out  = (up + up_offset) * gate * sigmoid(alpha * gate)

    gpt-oss: limit = config.swiglu_limit (7.0), alpha = config.swiglu_alpha (1.702), up_offset = 1. alpha = 1 and
    up_offset = 0 is SiLU(clamped gate) * clamped up (DeepSeek-V4's experts, for one). Where a clamp bites its input
    gets no gradient (torch's clamp: the bound itself still passes it)."""

    limit: float
    alpha: float = 1.702
    up_offset: float = 1.0

    def __post_init__(self):
        for field in ("limit", "alpha", "up_offset"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"activation.{field}: expected a finite real number, got {value!r}")
            object.__setattr__(self, field, float(value))
        if self.limit <= 0:
            raise ValueError(
                f"activation.limit: expected a number > 0 (gate <= limit, |up| <= limit), got {self.limit}"
            )


def check_activation(activation, *, gated: bool, allow_none: bool = True):
    """`activation` must be one of ACTIVATIONS (or None where allowed) or, with a gate, a ClampedSwiGLU."""
    if isinstance(activation, ClampedSwiGLU):
        if not gated:
            raise ValueError(
                f"activation: {activation} gates the up projection with the gate, so it needs a gated layout "
                "(gated / gate_layout 'concatenated' or 'interleaved'), got none"
            )
        return
    allowed = ((None,) if allow_none else ()) + ACTIVATIONS
    if not isinstance(activation, (str, type(None))) or activation not in allowed:
        raise ValueError(f"activation: expected one of {allowed} or a ClampedSwiGLU, got {activation!r}")


def apply_activation(x, activation):
    """act(x) for activation in (None, "silu", "gelu", "gelu_tanh", "relu2"); None is the identity. Elementwise, so
    it lowers inside a Mosaic kernel body and in XLA alike (tanh and the sigmoid's exp go to the EUP; Mosaic lowers
    erf on every generation)."""
    if activation is None:
        return x
    if activation == "silu":
        return x * jax.nn.sigmoid(x)
    if activation == "gelu":
        return 0.5 * x * (1.0 + jax.lax.erf(x * _SQRT_HALF))
    if activation == "gelu_tanh":
        return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    if activation == "relu2":
        r = jnp.maximum(x, 0.0)
        return r * r
    raise ValueError(f"activation: expected None or one of {ACTIVATIONS}, got {activation!r}")


def apply_gating(gate, up, activation):
    """The gated epilogue on f32 gate and up of one shape: act(gate) * up, or the ClampedSwiGLU."""
    if isinstance(activation, ClampedSwiGLU):
        limit = activation.limit
        # Selects, not min/max: no gradient where a clamp bites, all of it at the bound (as torch's clamp).
        gate = jnp.where(gate > limit, limit, gate)
        up = jnp.where(up > limit, limit, jnp.where(up < -limit, -limit, up))
        return (up + activation.up_offset) * (gate * jax.nn.sigmoid(activation.alpha * gate))
    return apply_activation(gate, activation) * up


# Output lanes of gate (and of up) per de-interleave matmul: 128 of each from 256 interleaved inputs, one [256, 256]
# selection matrix: a full-width pass of v6e's 256-wide MXU (two 128-wide matrices would each cost a full pass).
_PIECE = 128


def _deinterleave_matrix(width):
    """[2 w, 2 w] bf16 0/1 selection: output column j < w takes input lane 2 j (the gate), w + j takes 2 j + 1 (up)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (2 * width, 2 * width), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (2 * width, 2 * width), 1)
    source = jnp.where(cols < width, 2 * cols, 2 * (cols - width) + 1)
    return jnp.where(rows == source, 1.0, 0.0).astype(jnp.bfloat16)


def _deinterleave(piece, select):
    """[gate | up] of an interleaved f32 piece [rows, 2 w], exactly, as matmuls against the 0/1 `select`: Mosaic has
    no lane-strided slice. The piece is split into three bf16 parts (hi + mid + lo == piece to within f32 rounding),
    each selected exactly by one bf16 MXU pass with f32 accumulation: three passes instead of HIGHEST's six."""
    out = None
    rest = piece
    for i in range(3):
        part = rest.astype(jnp.bfloat16)
        if i < 2:
            rest = rest - part.astype(jnp.float32)
        picked = jnp.dot(part, select, preferred_element_type=jnp.float32)
        out = picked if out is None else out + picked
    return out


def deinterleaved_gating(h, activation):
    """The gated epilogue of an interleaved f32 pre-activation h [rows, 2 * n] (gate at even columns, up at odd),
    [rows, n], for kernel bodies. Piece by piece, 256 input lanes to 128 gate and 128 up lanes, so the selection work
    is 3 * 256 MACs per input element whatever the tile width (no [2n, 2n] selection matrix)."""
    n = h.shape[1] // 2
    selects = {}
    outs = []
    for start in range(0, n, _PIECE):
        width = min(_PIECE, n - start)
        if width not in selects:  # built once per kernel body, shared by the pieces
            selects[width] = _deinterleave_matrix(width)
        both = _deinterleave(h[:, 2 * start : 2 * (start + width)], selects[width])
        outs.append(apply_gating(both[:, :width], both[:, width:], activation))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
