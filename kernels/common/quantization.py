"""Quantized weights (int8, float8_e4m3fn) with per-output-channel f32 scales, as the grouped matmul and the MoE
small-batch kernel take them: `w[g, :, n] = q[g, :, n] * scale[g, n]` (the scale indexed by the output column
whatever the weight's orientation).

The kernels never materialize the dequantized weights: each weight block is cast in VMEM to the activations' dtype
(exact: every int8 and every e4m3 value is a bfloat16), multiplied on the MXU with f32 accumulation, and the scale
multiplies the f32 result's columns before the epilogue (bias, activation): one multiply per output element instead
of one per weight element.
"""

import jax.numpy as jnp

from .validation import check_array

QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
SCALE_DTYPES = (jnp.dtype(jnp.float32),)


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QUANTIZED_DTYPES


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
