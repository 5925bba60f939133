"""MXFP4 weights (OCP microscaling FP4), as gpt-oss checkpoints store them and transformers reads them.

Layout (transformers' `<proj>_blocks` / `<proj>_scales`): a weight [..., N, K] (N output channels, K the contraction
dimension, a multiple of 32) is

  - `blocks` uint8 [..., N, K / 32, 16] (or the same bytes as [..., N, K / 2]): two e2m1 codes a byte, the *low*
    nibble the even element (k = 2j) and the high nibble the odd one (k = 2j + 1), as transformers'
    `_convert_moe_packed_tensors` unpacks them (`lut[blk & 0x0F]` into columns 0::2, `lut[blk >> 4]` into 1::2);
  - `scales` uint8 [..., N, K / 32]: one e8m0 exponent per block of 32 consecutive k, w = e2m1 value * 2^(scale - 127).

e2m1 code c (s e e m): magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6 for c & 7 (transformers' FP4_VALUES), negative when
c & 8 (0x8 is -0). The reference dequantizes to f32 exactly (every value is an f32) for scales in [1, 254]; e8m0's
255 is NaN in the OCP format and gives NaN here too.
"""

import jax
import jax.numpy as jnp
import numpy as np

from . import quantization
from .validation import check_array

BLOCK = 32  # elements of the contraction dimension sharing one scale
CODE_DTYPE = jnp.dtype(jnp.uint8)
SCALE_DTYPE = jnp.dtype(jnp.uint8)
SCALE_ROW_TILE = 32  # uint8 rows a (32, 128) tile holds
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def is_mxfp4(dtype) -> bool:
    return jnp.dtype(dtype) == CODE_DTYPE


def packed(name: str, blocks):
    """`blocks` as [..., N, K / 2] (a free reshape of transformers' [..., N, K / 32, 16]); checks its dtype."""
    check_array(name, blocks, min_ndim=2, dtypes=(CODE_DTYPE,))
    if blocks.ndim >= 4 and blocks.shape[-1] == 16:
        return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * 16)
    return blocks


def scale_rows(k: int) -> int:
    """Rows of `prepare`'s scales for a contraction dimension K: K / 32 rounded up to 32, uint8's sublane tile, so
    that XLA stores them row-major (with K / 32 rows it stores them expert-minor-but-one, a relayout away from the
    kernel's blocks)."""
    return -(-(k // BLOCK) // SCALE_ROW_TILE) * SCALE_ROW_TILE


def check_scales(name: str, scales, *, blocks_name: str, blocks_shape: tuple, leading: tuple, transposed=True):
    """The e8m0 scales of packed blocks: blocks [*leading, N, K / 2] with scales uint8 [*leading, N, K / 32]
    (`transposed`, the checkpoint's orientation), or blocks [*leading, K / 2, N] with scales [*leading, S, N], S =
    K / 32 or `scale_rows(K)` (`prepare`'s, the rows past K / 32 ignored); K / 2 a multiple of 16."""
    half_k = blocks_shape[-1] if transposed else blocks_shape[-2]
    n = blocks_shape[-2] if transposed else blocks_shape[-1]
    if scales is None:
        shape = (*leading, n, half_k // 16) if transposed else (*leading, half_k // 16, n)
        raise ValueError(
            f"{name}: {blocks_name} is uint8 (MXFP4 blocks), so its e8m0 block scales uint8 {shape} are required, "
            "got None"
        )
    check_array(name, scales, dtypes=(SCALE_DTYPE,))
    if half_k % 16:
        raise ValueError(
            f"{blocks_name}: MXFP4 blocks hold 16 bytes (32 codes) per scale along the contraction dimension, got "
            f"{half_k} bytes (shape {tuple(blocks_shape)}), not a multiple of 16"
        )
    if transposed:
        expected = [(*leading, n, half_k // 16)]
    else:
        expected = [(*leading, rows, n) for rows in dict.fromkeys((half_k // 16, scale_rows(2 * half_k)))]
    if tuple(scales.shape) not in expected:
        raise ValueError(
            f"{name}: expected shape {' or '.join(map(str, expected))} (one scale per 32 contraction elements of "
            f"{blocks_name} {tuple(blocks_shape)}), got {tuple(scales.shape)}"
        )


def prepare(blocks, scales):
    """The one-time layout of MXFP4 weights for the kernels: checkpoint blocks uint8 [..., N, K / 2] (or
    [..., N, K / 32, 16]) and scales uint8 [..., N, K / 32] -> blocks [..., K / 2, N] and scales
    [..., scale_rows(K), N] (zero rows past K / 32): the contraction dimension on sublanes, N on lanes, the layout
    XLA stores them in when N is a multiple of 128 and K / 2 of 32, so that a call reads them with no copy. The
    checkpoint's [..., N, K / 2] is stored N-minor already (a free transpose), but its scales are not, and the 4-D
    form is tiled differently: as given, a call relayouts them on every call. Run it once, at load."""
    blocks = packed("blocks", blocks)
    check_scales("scales", scales, blocks_name="blocks", blocks_shape=blocks.shape, leading=tuple(blocks.shape[:-2]))
    k = 2 * blocks.shape[-1]
    scales = jnp.swapaxes(scales, -1, -2)
    pad = [(0, 0)] * (scales.ndim - 2) + [(0, scale_rows(k) - k // BLOCK), (0, 0)]
    return jnp.swapaxes(blocks, -1, -2), jnp.pad(scales, pad)


def _fp4_bits(code):
    """f32 bit patterns of e2m1 codes (int32 in [0, 16)): magnitude c & 7 -> 2^(e - 1) (1 + m / 2), 0.5, 0."""
    magnitude = code & 7
    normal = (magnitude << 22) + (126 << 23)  # e >= 1: exponent e - 1 + 127, mantissa bit m at bit 22
    bits = jnp.where(magnitude >= 2, normal, jnp.where(magnitude == 1, 126 << 23, 0))
    return bits | ((code & 8) << 28)


def _scale_f32(scales):
    """2^(s - 127) as f32 from e8m0 bytes (int32): the byte is the f32 exponent field (255: NaN)."""
    return jax.lax.bitcast_convert_type(jnp.where(scales == 255, 0x7FC00000, scales << 23), jnp.float32)


def dequantize(blocks, scales):
    """Reference: f32 [..., N, K] from blocks uint8 [..., N, K / 2] (or [..., N, K / 32, 16]) and scales uint8
    [..., N, K / 32]."""
    blocks = packed("blocks", blocks).astype(jnp.int32)
    codes = jnp.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    values = jax.lax.bitcast_convert_type(_fp4_bits(codes), jnp.float32)
    scale = jnp.repeat(_scale_f32(scales.astype(jnp.int32)), BLOCK, axis=-1)
    return values * scale


def dequantize_prepared(blocks, scales):
    """Reference: f32 [..., N, K] (the checkpoint's orientation) from `prepare`'s blocks uint8 [..., K / 2, N] and
    scales uint8 [..., S, N]."""
    half_k = blocks.shape[-2]
    return dequantize(jnp.swapaxes(blocks, -1, -2), jnp.swapaxes(scales[..., : half_k // 16, :], -1, -2))


def even_odd(x):
    """x [..., K] as [..., K] with its even columns first, then its odd ones: the order `widen` gives the packed
    weights' contraction dimension in (low nibbles, then high nibbles)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def widen(block, scales, dtype):
    """In VMEM: packed blocks [K / 2, C] uint8 (the contraction dimension on sublanes, as `prepare` lays them out)
    and their scales [S >= K / 32, C] uint8 -> the weights of the even and of the odd contraction elements, two
    [K / 2, C] arrays in `dtype`, exact.

    Each nibble is rewritten, with 8-bit and / shift / or on the packed bytes, as the float8_e4m3fn byte of the same
    sign, exponent and mantissa bits (s 0 e e m 0 0 -> s 0 0 e e m 0 0): its value is the e2m1 value times 2^-6,
    subnormals included, and `quantization.widen` unpacks it as it unpacks e4m3 weights (on v5e / v6e through the
    chips' e4m3b11, a further 2^-4). The block scale, times the inverse of those powers of two, is built as bf16 bits
    (the e8m0 byte is the exponent field), broadcast over its 16 rows (a sublane broadcast) and multiplies the bf16
    values (exact: two significant bits times a power of two). e8m0 0 gives 0, 255 NaN; exponents past 254 -
    log2(that factor) (2^117 and up on v5e / v6e) are out of range."""
    half_k, cols = block.shape
    codes = jax.lax.bitcast_convert_type(block, jnp.int8)
    planes = (
        ((codes & 0x8) << 4) | ((codes & 0x7) << 2),  # low nibble (the even element)
        (codes & jnp.int8(-128)) | ((codes >> 2) & 0x1C),  # high nibble (the odd element)
    )
    shift = 6 + int(np.log2(quantization.widen_factor(jnp.float8_e4m3fn)))
    exponent = scales[: half_k // 16].astype(jnp.int32)
    bits = jnp.where(exponent == 255, 0x7FC00000, jnp.where(exponent == 0, 0, (exponent + shift) << 23))
    scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    scale = jnp.broadcast_to(scale[:, None, :], (half_k // 16, 16, cols)).reshape(half_k, cols).astype(jnp.bfloat16)
    widened = []
    for p in planes:
        # No rewritten byte is e4m3fn's NaN; -0 (0x80) reads as NaN through e4m3b11 and is made 0 here, in bf16.
        w = quantization.widen(jax.lax.bitcast_convert_type(p, jnp.float8_e4m3fn), jnp.bfloat16, special_codes=False)
        widened.append((jnp.where(jnp.isnan(w), jnp.bfloat16(0), w) * scale).astype(dtype))
    return tuple(widened)
