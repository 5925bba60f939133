"""Inverse RoPE frequencies as transformers' rope init functions define them (`transformers/modeling_rope_utils.py`):
"default", "linear", "llama3", "yarn" and "proportional" (Gemma 4's partial rotary), in float32 like transformers.

`scaling` is a transformers-style rope_parameters dict ({"rope_type": ..., "factor": ..., ...}) or None (default).
`cos_sin` builds the cos/sin tables from positions with them, as transformers' rotary embedding does.
"""

import math

import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "proportional": {"factor", "partial_rotary_factor"},
}
_REQUIRED = {
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings"},
}
# Keys transformers keeps in rope_parameters that do not change the frequencies computed here.
_IGNORED = {"rope_type", "rope_theta"}


def _number(name, value, *, positive=True):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"scaling[{name!r}]: expected a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"scaling[{name!r}]: expected a number > 0, got {value!r}")
    return float(value)


def check_scaling(scaling) -> dict:
    """Validate a rope_parameters-style dict; returns it with rope_type filled in."""
    if scaling is None:
        return {"rope_type": "default"}
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling: expected None or a dict of rope parameters, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"scaling['rope_type']: expected one of {ROPE_TYPES}, got {rope_type!r}")
    unknown = set(scaling) - ROPE_KEYS[rope_type] - _IGNORED - {"type"}
    if unknown:
        raise ValueError(f"scaling: unexpected key(s) {sorted(unknown)} for rope_type {rope_type!r}")
    missing = _REQUIRED.get(rope_type, set()) - {k for k, v in scaling.items() if v is not None}
    if missing:
        raise ValueError(f"scaling: rope_type {rope_type!r} needs {sorted(missing)}")
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
    ):
        if scaling.get(key) is not None:
            _number(key, scaling[key])
    if rope_type == "proportional":
        prf = _number("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0))
        if prf > 1:
            raise ValueError(f"scaling['partial_rotary_factor']: expected a number in (0, 1], got {prf}")
    return {**scaling, "rope_type": rope_type}


def _base_inv_freq(theta, dim):
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def inverse_frequencies(head_dim: int, theta: float, rotary_dim: int, scaling=None) -> tuple[np.ndarray, float, int]:
    """(inv_freq [n] float32, attention_scaling, rotated lanes 2n) for a head of `head_dim` whose first `rotary_dim`
    features rotate (for "proportional", rotary_dim is ignored: all head_dim lanes carry frequencies, the last ones 0).
    """
    scaling = check_scaling(scaling)
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        return _base_inv_freq(theta, rotary_dim), 1.0, rotary_dim
    if rope_type == "linear":
        return (_base_inv_freq(theta, rotary_dim) / np.float32(scaling["factor"])).astype(np.float32), 1.0, rotary_dim
    if rope_type == "proportional":
        rope_angles = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        exponents = np.arange(0, 2 * rope_angles, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        rotated = np.float32(1.0) / (np.float32(theta) ** exponents)
        inv = np.concatenate([rotated, np.zeros(head_dim // 2 - rope_angles, np.float32)]).astype(np.float32)
        return (inv / np.float32(scaling.get("factor", 1.0))).astype(np.float32), 1.0, head_dim
    if rope_type == "llama3":
        inv = _base_inv_freq(theta, rotary_dim)
        factor = np.float32(scaling["factor"])
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
        inv_llama = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
        smooth = ((np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * inv_llama / factor + smooth * inv_llama).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, inv_llama).astype(np.float32), 1.0, rotary_dim
    # yarn
    dim = rotary_dim
    factor = float(scaling["factor"])
    orig = scaling["original_max_position_embeddings"]

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = (np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (1 - ramp).astype(np.float32)
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv.astype(np.float32), float(attention_factor), rotary_dim


def cos_sin(positions, inv_freq, attention_scaling: float = 1.0, *, interleaved: bool = False):
    """cos/sin tables [B, S, 2n] (f32) for positions [B, S] and inverse frequencies [n]: the f32 angles
    positions * inv_freq, cos and sin times attention_scaling, each frequency on two lanes (lanes i and i + n, or 2i
    and 2i + 1 when interleaved). Each distinct angle is evaluated once, then laid out on its two lanes."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles) * attention_scaling, jnp.sin(angles) * attention_scaling
    if interleaved:
        return jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)
