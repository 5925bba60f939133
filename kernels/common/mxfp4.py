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
from jax.experimental.pallas import tpu as pltpu

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


# The prepared blocks' bits. Each 32-bit word of the blocks as the kernel reads them (4 consecutive K / 2 rows of a
# column, little-endian: row 4i + b is byte b) holds the 8 contraction elements k = 8i + j, j = 2p + h, re-encoded so
# that `widen` turns the word into its 4 planes p (two bf16 values each, j = 2p in the low half and 2p + 1 in the
# high half) with a shift and a mask or two. A value's 4 bits land on its bf16 half's sign (bit 15) and on the two
# low exponent bits and the high mantissa bit (bits 8, 7, 6): the magnitude field q = 2e + m reads 2^(e - 1)(1 + m / 2)
# once the block's scale is added to the exponent, so 0.5 is q = 0 and q = 1 (0.75, not an e2m1 value) is the code of
# zero. _PLANES[p]: ((left shift of the word, output bits), ...) whose masked terms are or-ed; a negative shift is a
# right shift.
_SIGN = (15, 31)
_MAGNITUDE = (6, 7, 8, 22, 23, 24)
_PLANES = (
    ((6, _MAGNITUDE + _SIGN),),
    ((3, _MAGNITUDE + _SIGN),),
    ((0, _MAGNITUDE), (4, _SIGN)),
    ((-7, _MAGNITUDE), (5, _SIGN)),
)
_ZERO_Q = 1  # the magnitude code of zero
# Per value j = 2p + h: its 4 fields (sign, e1, e0, m: bit 3, 2, 1, 0 of the re-encoded nibble) as word bits.
_FIELD_OUT = (15, 8, 7, 6)


def _word_bit(j: int, field: int) -> int:
    p, h = divmod(j, 2)
    out = _FIELD_OUT[field] + 16 * h
    for shift, bits in _PLANES[p]:
        if out in bits:
            return out - shift
    raise AssertionError((j, field))


_WORD_BITS = {_word_bit(j, f): (j, f) for j in range(8) for f in range(4)}  # word bit -> (value j, field)
assert sorted(_WORD_BITS) == list(range(32))


def _mask(bits) -> int:
    return sum(1 << b for b in bits)


def encode(blocks, scales, *, where, stack):
    """The prepared bytes, in the checkpoint's orientation: blocks uint8 [..., N, K / 2] and scales uint8
    [..., N, K / 32] -> (blocks uint8 [..., N, K / 2] re-encoded for `widen`, scales uint8 [..., N, K / 32]). Written
    with the operators numpy, jax and torch share (uint8 shifts and masks; `where` and `stack`, which stacks a list
    on a new last axis, given), so that torch's prepare_mxfp4_experts writes the same bytes. The reference's values
    are kept exactly (up to the sign of zeros) wherever a bf16 exponent holds them: scale 0 blocks (the reference's 0)
    become zero codes, scale 255 (NaN) blocks q = 7 codes under scale 253 (bf16 NaN), and the codes of scale 253 / 254
    blocks that overflow (to +-inf) that scale's +-inf code. Scale 1's +-0.5 (2^-127, below bf16's normals) reads as
    0."""
    *lead, n, half_k = blocks.shape
    groups = half_k // 16
    b = blocks.reshape(*lead, n, groups, 4, 4)  # [..., N, group, word, byte]: element k = 32 group + 8 word + j
    s = scales.reshape(*lead, n, groups, 1)
    zero, nan, big = s == 0, s == 255, s >= 253
    over = (255 - s) + 1  # 256 - s: the exponent code e from which a value of scale s overflows
    nibbles = []
    for j in range(8):
        code = (b[..., j // 2] >> (4 * (j % 2))) & 15
        mag = code & 7
        q = where(mag == 0, _ZERO_Q, where(mag == 1, 0, mag))
        q = where(big & ((q >> 1) >= over), over << 1, q)
        q = where(zero, _ZERO_Q, where(nan, 7, q))
        sign = where((mag == 0) | zero | nan, 0, code >> 3)
        nibbles.append((sign << 3) | q)
    words = []
    for byte in range(4):
        acc = None
        for bit in range(8):
            j, field = _WORD_BITS[8 * byte + bit]
            term = ((nibbles[j] >> (3 - field)) & 1) << bit
            acc = term if acc is None else acc | term
        words.append(acc)
    out_scales = where(nan, 253, s).reshape(*lead, n, groups)
    return stack(words).reshape(*lead, n, half_k), out_scales


def prepare(blocks, scales):
    """The one-time layout of MXFP4 weights for the kernels: checkpoint blocks uint8 [..., N, K / 2] (or
    [..., N, K / 32, 16]) and scales uint8 [..., N, K / 32] -> blocks [..., K / 2, N] and scales
    [..., scale_rows(K), N] (zero rows past K / 32): the contraction dimension on sublanes, N on lanes, the layout
    XLA stores them in when N is a multiple of 128 and K / 2 of 32, so that a call reads them with no copy; the
    blocks' bits re-encoded for `widen` (`encode`). The checkpoint's [..., N, K / 2] is stored N-minor already, but
    its scales are not, and the 4-D form is tiled differently: as given, a call converts them on every call. Run it
    once, at load."""
    blocks = packed("blocks", blocks)
    check_scales("scales", scales, blocks_name="blocks", blocks_shape=blocks.shape, leading=tuple(blocks.shape[:-2]))
    k = 2 * blocks.shape[-1]
    blocks, scales = encode(blocks, scales, where=jnp.where, stack=lambda xs: jnp.stack(xs, axis=-1))
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


def _prepared_codes(blocks):
    """`prepare`'s blocks uint8 [..., K / 2, N] -> the re-encoded nibbles (sign << 3 | q) int32 [..., N, K]."""
    w = jnp.swapaxes(blocks, -1, -2).astype(jnp.int32)
    *lead, n, half_k = w.shape
    w = w.reshape(*lead, n, half_k // 4, 4)
    nibbles = []
    for j in range(8):
        bits = {f: b for b, (jj, f) in _WORD_BITS.items() if jj == j}
        nibbles.append(sum(((w[..., bits[f] // 8] >> (bits[f] % 8)) & 1) << (3 - f) for f in range(4)))
    return jnp.stack(nibbles, axis=-1).reshape(*lead, n, 2 * half_k)


def dequantize_prepared(blocks, scales):
    """Reference: f32 [..., N, K] (the checkpoint's orientation) from `prepare`'s blocks uint8 [..., K / 2, N] and
    scales uint8 [..., S, N]: each value's bf16 bits as `widen` builds them (sign, exponent e + scale - 1, mantissa
    m; 0 for the zero code), decoded from the re-encoded nibbles independently of `widen`'s word arithmetic."""
    half_k = blocks.shape[-2]
    nib = _prepared_codes(blocks)
    scale = jnp.repeat(jnp.swapaxes(scales[..., : half_k // 16, :], -1, -2).astype(jnp.int32), BLOCK, axis=-1)
    q = nib & 7
    bits = ((nib >> 3) << 15) | (((q >> 1) + scale - 1) << 7) | ((q & 1) << 6)
    bits = jnp.where(q == _ZERO_Q, 0, bits).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


def plane_order(x):
    """x [..., K] with its columns in `widen`'s plane order: plane p's contraction elements k = 8 i + 2 p + h (in
    order of i, then h) for p = 0..3, each plane K / 4 columns, to meet the planes of the prepared weights."""
    *lead, k = x.shape
    return jnp.swapaxes(x.reshape(*lead, k // 8, 4, 2), -3, -2).reshape(*lead, k)


def widen(block, scales, dtype):
    """In VMEM: `prepare`'s packed blocks [K / 2, C] uint8 and their scales [S >= K / 32, C] uint8 -> the weights of
    the 4 planes (`plane_order`), four [K / 4, C] arrays in `dtype`, exact (see `encode` for the scales' range).

    On whole 32-bit words (4 rows of bytes, 8 values): plane p is the word shifted and masked (or two such terms
    or-ed) so that each 16-bit half holds its value's sign and q = 2e + m at the bf16 sign, low exponent and high
    mantissa bits; adding (scale - 1) << 7 to both halves (one 32-bit add: the exponent never carries into the sign)
    makes it the bf16 value, and the zero code (q = 1) is made 0 by a 16-bit select, which the compiler folds into the
    MXU's masked weight push. The word is read as two bf16 rows (its low half the even one): plane p's row 2 i + h is
    element k = 8 i + 2 p + h of the word's row i."""
    half_k, cols = block.shape
    groups = half_k // 16
    words = pltpu.bitcast(block, jnp.uint32)  # [K / 8, C]: row i holds k = 8 i .. 8 i + 7
    exponent = scales[:groups].astype(jnp.int32)
    bias = ((exponent - 1) << 7) * 0x10001  # scale 0's is never used: its blocks hold only zero codes
    bias = jnp.broadcast_to(bias[:, None, :], (groups, 4, cols)).reshape(half_k // 4, cols)
    bias = jax.lax.bitcast_convert_type(bias, jnp.uint32)
    planes = []
    for terms in _PLANES:
        y = None
        for shift, bits in terms:
            t = words << shift if shift > 0 else (words >> -shift if shift < 0 else words)
            t = t & jnp.uint32(_mask(bits))
            y = t if y is None else y | t
        zero = pltpu.bitcast(y, jnp.int16) == jnp.int16(_ZERO_Q << 6)
        value = jnp.where(zero, jnp.int16(0), pltpu.bitcast(y + bias, jnp.int16))
        planes.append(pltpu.bitcast(value, jnp.bfloat16).astype(dtype))
    return tuple(planes)
