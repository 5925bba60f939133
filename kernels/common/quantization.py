"""Quantized weights (int8, float8_e4m3fn) with per-output-channel f32 scales, as the grouped matmul and the MoE
small-batch kernel take them: `w[g, :, n] = q[g, :, n] * scale[g, n]` (the scale indexed by the output column
whatever the weight's orientation).

The kernels never materialize the dequantized weights: each weight block is widened in VMEM to the activations' dtype
(`widen`; exact: every int8 and every e4m3 value is a bfloat16, up to the power of two `widen_factor`), multiplied on
the MXU with f32 accumulation, and the scale (times that factor) multiplies the f32 result's columns before the
epilogue (bias, activation): one multiply per output element instead of one per weight element.

On v5e and v6e, float8_e4m3fn is widened through their native e4m3 format, e4m3b11 (exponent bias 11, jax's
float8_e4m3b11fnuz):
the same sign / 4 exponent / 3 mantissa fields, so the e4m3fn byte read as e4m3b11 is the value times 2^-4, subnormals
included, and the vector unit unpacks it straight to bf16. Mosaic's own e4m3fn conversion unpacks the same way and
then runs an f32 adjustment (the 2^4 and the special codes) on every element, which made the small-batch kernel
compute-bound (modeled v6e, Qwen3 at 64 tokens: 5149 cycles a step against 3179 here). The 2^4 is folded into the
f32 column scale instead, and the two codes whose meaning differs are fixed in the bf16 bits (16-bit integer ops):
e4m3fn's -0 (0x80) is e4m3b11fnuz's NaN, made 0 again; e4m3fn's NaN (0x7F / 0xFF) reads as +-30 (the largest
e4m3b11fnuz magnitude, which no other e4m3fn code reaches once scaled), made NaN. v7x converts e4m3fn natively (and
would emulate e4m3b11 at ~20x the cost, modeled), so there, and on any other generation, the block is cast as it is.
"""

import jax
import jax.numpy as jnp

from . import chip
from .validation import check_array

QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
SCALE_DTYPES = (jnp.dtype(jnp.float32),)


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QUANTIZED_DTYPES


_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
# The bf16 bits e4m3fn's NaN codes take when read as e4m3b11fnuz (+-30 = 1.875 * 2^4; sign masked off).
_E4M3FN_NAN_AS_B11 = 0x41F0


_B11_GENERATIONS = ("v5e", "v6e")


def _via_b11(dtype) -> bool:
    return jnp.dtype(dtype) == _E4M3 and chip.generation_name(chip.current_tpu_info()) in _B11_GENERATIONS


def widen_factor(dtype) -> float:
    """What `widen`'s output must be multiplied by to give the weights' values, for the generation being traced for:
    2^4 for e4m3fn read as e4m3b11, 1 otherwise."""
    return 16.0 if _via_b11(dtype) else 1.0


def widen(block, dtype, *, special_codes=True):
    """A quantized (or float) weight block in VMEM as `dtype` (bf16 / f32) for the MXU, exactly, divided by
    `widen_factor(block.dtype)`; see the module docstring for float8_e4m3fn. `special_codes=False` skips the
    fix-up of e4m3fn's -0 and NaN codes where the block is read as e4m3b11 (-0 then comes out NaN, NaN +-30): for a
    caller whose bytes hold no NaN code and which fixes -0 itself."""
    if not _via_b11(block.dtype):
        return block.astype(dtype)
    as_b11 = jax.lax.bitcast_convert_type(block, jnp.float8_e4m3b11fnuz)
    if not special_codes:
        return as_b11.astype(dtype)
    wide = jax.lax.bitcast_convert_type(as_b11.astype(jnp.bfloat16), jnp.int16)
    magnitude = wide & jnp.int16(0x7FFF)
    wide = jnp.where(magnitude > 0x7F80, jnp.int16(0), wide)  # e4m3fn -0, read as NaN: 0
    wide = jnp.where(magnitude == _E4M3FN_NAN_AS_B11, jnp.int16(0x7FC0), wide)  # e4m3fn NaN, read as +-30: NaN
    return jax.lax.bitcast_convert_type(wide, jnp.bfloat16).astype(dtype)


def compute_dtype(activation_dtype, weight_dtype):
    """The dtype a matmul runs in: the promoted dtype of its operands, or the activations' own against quantized
    weights (which are cast to it in VMEM; jax has no implicit promotion for 8-bit floats)."""
    if is_quantized(weight_dtype):
        return jnp.dtype(activation_dtype)
    return jnp.promote_types(activation_dtype, weight_dtype)


def check_scale(name: str, scale, *, weight_name: str, weight, expected_shape: tuple, shape_doc: str):
    """A weight's scale argument: required (f32, `expected_shape`) with a quantized weight, refused with any other."""
    weight_dtype = jnp.dtype(weight.dtype)
    if not is_quantized(weight_dtype):
        if scale is not None:
            raise ValueError(
                f"{name}: a scale goes with quantized weights ({' / '.join(map(str, QUANTIZED_DTYPES))}), got "
                f"{weight_name} in {weight_dtype}"
            )
        return
    if scale is None:
        raise ValueError(
            f"{name}: {weight_name} is {weight_dtype} (quantized), so its per-output-channel scale {shape_doc} "
            "float32 is required, got None"
        )
    check_array(name, scale, dtypes=SCALE_DTYPES)
    if tuple(scale.shape) != tuple(expected_shape):
        raise ValueError(f"{name}: expected shape {tuple(expected_shape)} {shape_doc}, got {tuple(scale.shape)}")
