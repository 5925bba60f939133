"""Public JAX API of the ragged dot (grouped matmul): validation, block choice and custom_vjp wiring.

Semantics are `jax.lax.ragged_dot`'s: lhs [M, K] with rows sorted by group, rhs [G, K, N] (or [G, N, K] with
`rhs_transposed`), group_sizes [G] int32; group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])) and
out[r] = lhs[r] @ rhs[g(r)]; rows past sum(group_sizes) come out zero. Output dtype: `preferred_element_type`, else
the promoted dtype of lhs and rhs. Accumulation is always f32.

Local group window (expert parallelism). `group_offset` and `num_local_groups` say that only groups
[group_offset, group_offset + num_local_groups) live here; rows of every other group come out zero. group_sizes
always covers every group (G entries, as the router produced them), so each shard sees the same row layout. rhs may
hold either
  - only the window: rhs.shape[0] == num_local_groups (the expert-parallel layout: each shard holds its slice of
    the expert weights, and group_offset = shard index * num_local_groups, possibly a traced value such as
    `jax.lax.axis_index(...) * n` inside shard_map), or
  - every group: rhs.shape[0] == G, of which only the window is used.
num_local_groups defaults to G (no window; rhs must then hold G groups). group_offset is a Python int or an integer
scalar array (shape () or (1,)); a concrete one is checked to keep the window inside [0, G); a traced one cannot be,
and window groups outside [0, G) then contribute nothing.

MXFP4 rhs (inference, forward only): uint8 rhs [rhs groups, N, K / 2] (or transformers' [rhs groups, N, K / 32, 16])
holding two e2m1 codes a byte, rhs_transposed=True, with `rhs_scale` uint8 [rhs groups, N, K / 32], one e8m0 scale
per 32 contraction elements (common/mxfp4.py); or, laid out once by `mxfp4.prepare`, rhs [rhs groups, K / 2, N] with
rhs_scale [rhs groups, mxfp4.scale_rows(K), N] and rhs_transposed=False, which is what the kernel reads (the
checkpoint's layout is converted to it on every call). The kernel widens each weight block whole along K in VMEM,
the block scales applied to the weights before the MXU, against lhs with its columns in the weights' plane order.

Quantized rhs (inference): int8 or float8_e4m3fn rhs with `rhs_scale` [rhs groups, N] f32, one scale per output
column of each group (w = q * scale). Each weight block is cast to lhs's dtype in VMEM (exact) and the scale multiplies
the f32 result's columns before the bias and the epilogue; the output dtype defaults to lhs's. Differentiable in lhs,
bias and row_scale (d lhs = (g * scale) @ q^T through the same kernel); the quantized rhs and its scale are constants
(zero cotangent), as transformers' FP8 layers treat them.

Row scale (for the MoE down projection): `row_scale` [M] multiplies each output row last, in the kernel's epilogue
(the routing weight of each sorted (token, expert) row), so the weighted rows are written once.

Fused epilogue (for the MoE gate/up projection): `bias` [rhs groups, N] is added per group; `activation` in
{None, "silu", "gelu", "gelu_tanh", "relu2"} or, gated only, a `ClampedSwiGLU(limit, alpha, up_offset)` (gpt-oss's
gating: (clip(up, -limit, limit) + up_offset) * g * sigmoid(alpha * g), g = min(gate, limit)); with
`gated="concatenated"` (gate = columns [0, N/2), up = [N/2, N)) or `gated="interleaved"` (gate = even columns,
up = odd) the output is act(gate) * up (or the ClampedSwiGLU), of width N/2, written once. A concatenated layout
whose halves the kernel cannot read as aligned blocks (see `_fusable`) is computed unfused (the grouped matmul in
f32, then the epilogue in XLA), which is correct but does an extra pass over the [M, N] intermediate.

Checks that need values (negative group sizes, sizes summing past M, the window of a concrete group_offset) run when
those values are concrete; under jit they are traced and unchecked: the kernel then treats negative sizes as zero and
drops rows past M, so it never reads or writes out of bounds.

Differentiable in lhs, rhs, bias and row_scale, including through the activation/gated epilogue (its backward
recomputes the pre-activation with the forward kernel and differentiates the epilogue and the row scale in XLA).
group_sizes and group_offset get no gradient.

Tiles (`blocks=`, a `RaggedDotBlocks`): the blocks of each kernel the op runs, the forward one and the three of the
backward (see `tuning.RaggedDotBlocks` for which is which); whatever is left None is the tuning table's choice, so
None is the table. Given tiles are checked before tracing against the layout (sublane and lane tiles) and the VMEM of
the generation being traced for. Being static, they are part of the jit cache key.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..common import chip, mxfp4, quantization
from ..common.activation import apply_activation, apply_gating, check_activation
from ..common.blocks import sublane_multiple
from ..common.interpret import interpret_eager_cpu_calls
from ..common.manual_axes import cotangents_like
from ..common.validation import check_array, check_bool, is_concrete
from . import kernel, metadata, tuning
from .tuning import MatmulBlocks, RaggedDotBlocks, TransposedMatmulBlocks

MATMUL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
RHS_DTYPES = MATMUL_DTYPES + quantization.QUANTIZED_DTYPES + (mxfp4.CODE_DTYPE,)
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
GATED = (None, "concatenated", "interleaved")
MXFP4_TN = tuning.MXFP4_TN


@dataclasses.dataclass(frozen=True)
class _Kernels:
    """The resolved blocks of every kernel one call runs (all fields set); None where that kernel does not run."""

    forward: MatmulBlocks
    recompute: MatmulBlocks | None
    lhs_grad: MatmulBlocks
    rhs_grad: TransposedMatmulBlocks | None  # None for quantized (constant) rhs


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static facts of one call (hashable: a custom_vjp non-differentiable argument)."""

    out_dtype: jnp.dtype
    rhs_transposed: bool
    num_local_groups: int
    rhs_global: bool  # rhs holds every group (index = group_offset + local index), else only the window
    activation: str | None
    gated: str | None
    static_grid: bool
    quantized: bool = False  # int8 / float8_e4m3fn rhs with a per-column scale (forward and d lhs only)
    mxfp4: bool = False  # MXFP4 rhs (packed e2m1 pairs, e8m0 block scales along K): forward only
    kernels: _Kernels | None = None  # None when no kernel runs (M, N, K or the window empty)


def _check_group_offset(group_offset):
    if isinstance(group_offset, bool):
        raise TypeError("group_offset: expected an int or an integer scalar array, got bool")
    if isinstance(group_offset, (int, np.integer)):
        return int(group_offset)
    if not hasattr(group_offset, "dtype") or not jnp.issubdtype(group_offset.dtype, jnp.integer):
        raise TypeError(f"group_offset: expected an int or an integer scalar array, got {type(group_offset).__name__}")
    if tuple(group_offset.shape) not in ((), (1,)):
        raise ValueError(f"group_offset: expected shape () or (1,), got {tuple(group_offset.shape)}")
    group_offset = jnp.asarray(group_offset).reshape(()).astype(jnp.int32)
    if is_concrete(group_offset):
        return int(group_offset)
    return group_offset


def check_inputs(
    lhs,
    rhs,
    group_sizes,
    *,
    preferred_element_type=None,
    rhs_transposed=False,
    group_offset=0,
    num_local_groups=None,
    bias=None,
    activation=None,
    gated=None,
    row_scale=None,
    rhs_scale=None,
    blocks=None,
    owner="blocks",
):
    """Validate ragged_dot's arguments (its defaults); return (config, group_offset as int or traced int32 scalar,
    n_out).

    `blocks` (a RaggedDotBlocks or None) is resolved into the blocks of every kernel the call runs; `owner` is how
    errors name it (the MoE passes its own field, e.g. "blocks.gate_up")."""
    lhs_dtype = check_array("lhs", lhs, ndim=2, dtypes=MATMUL_DTYPES)
    rhs_dtype = check_array("rhs", rhs, ndim=3, dtypes=RHS_DTYPES)
    check_array("group_sizes", group_sizes, ndim=1, dtypes=(jnp.dtype(jnp.int32),))
    check_bool("rhs_transposed", rhs_transposed)
    blocks = tuning.check_ragged_dot_blocks(blocks, owner)
    m, k = lhs.shape
    num_groups = group_sizes.shape[0]
    rhs_groups = rhs.shape[0]
    is_mxfp4 = mxfp4.is_mxfp4(rhs_dtype)
    rhs_k, n = (rhs.shape[2], rhs.shape[1]) if rhs_transposed else (rhs.shape[1], rhs.shape[2])
    if is_mxfp4:
        rhs_k *= 2  # two codes a byte
    layout = "[G, N, K] (rhs_transposed=True)" if rhs_transposed else "[G, K, N]"
    if rhs_k != k:
        raise ValueError(
            f"rhs: contraction dimension {rhs_k} of rhs {tuple(rhs.shape)} (layout {layout}) does not match lhs's "
            f"K = {k} (lhs shape {tuple(lhs.shape)})"
        )
    if preferred_element_type is None:
        out_dtype = quantization.compute_dtype(lhs_dtype, rhs_dtype)
    else:
        try:
            out_dtype = jnp.dtype(preferred_element_type)
        except TypeError as e:
            raise TypeError(f"preferred_element_type: expected a float dtype, got {preferred_element_type!r}") from e
        if out_dtype not in OUT_DTYPES:
            raise TypeError(
                f"preferred_element_type: expected one of ({', '.join(map(str, OUT_DTYPES))}), got {out_dtype}"
            )
    if num_local_groups is None:
        if rhs_groups != num_groups:
            raise ValueError(
                f"rhs: expected {num_groups} groups (len(group_sizes)) in dimension 0, got shape {tuple(rhs.shape)}; "
                "for a local group window pass num_local_groups (and group_offset)"
            )
        n_local = rhs_groups
    else:
        if isinstance(num_local_groups, bool) or not isinstance(num_local_groups, (int, np.integer)):
            raise TypeError(f"num_local_groups: expected an int, got {type(num_local_groups).__name__}")
        n_local = int(num_local_groups)
    if n_local < 0 or n_local > num_groups:
        raise ValueError(
            f"num_local_groups: expected 0 <= num_local_groups <= {num_groups} (len(group_sizes)), got {n_local}"
        )
    if rhs_groups not in (n_local, num_groups):
        raise ValueError(
            f"rhs: expected {n_local} groups (the local window, num_local_groups) or {num_groups} (every group, "
            f"len(group_sizes)) in dimension 0, got shape {tuple(rhs.shape)}"
        )
    rhs_global = rhs_groups == num_groups and n_local != num_groups
    group_offset = _check_group_offset(group_offset)
    if isinstance(group_offset, int) and not (0 <= group_offset and group_offset + n_local <= num_groups):
        raise ValueError(
            f"group_offset: the window [group_offset, group_offset + num_local_groups) = [{group_offset}, "
            f"{group_offset + n_local}) must lie inside [0, {num_groups}) (len(group_sizes))"
        )
    if gated not in GATED:
        raise ValueError(f"gated: expected one of {GATED}, got {gated!r}")
    check_activation(activation, gated=gated is not None)
    if gated is not None and n % 2:
        raise ValueError(f"rhs: gated={gated!r} needs an even number of output columns N, got N = {n}")
    if bias is not None:
        check_array("bias", bias, ndim=2, dtypes=MATMUL_DTYPES)
        if tuple(bias.shape) != (rhs_groups, n):
            raise ValueError(f"bias: expected shape {(rhs_groups, n)} (rhs groups, N), got {tuple(bias.shape)}")
    if is_mxfp4:
        mxfp4.check_scales(
            "rhs_scale",
            rhs_scale,
            blocks_name="rhs",
            blocks_shape=rhs.shape,
            leading=(rhs_groups,),
            transposed=rhs_transposed,
        )
    else:
        quantization.check_scale(
            "rhs_scale",
            rhs_scale,
            weight_name="rhs",
            weight=rhs,
            expected_shape=(rhs_groups, n),
            shape_doc="(rhs groups, N)",
        )
    if row_scale is not None:
        check_array("row_scale", row_scale, ndim=1, dtypes=MATMUL_DTYPES)
        if row_scale.shape[0] != m:
            raise ValueError(f"row_scale: expected shape ({m},) (lhs rows), got {tuple(row_scale.shape)}")
    if is_concrete(group_sizes):
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any():
            bad = int(np.flatnonzero(sizes < 0)[0])
            raise ValueError(f"group_sizes: expected sizes >= 0, got group_sizes[{bad}] = {int(sizes[bad])}")
        total = int(sizes.astype(np.int64).sum())
        if total > m:
            raise ValueError(f"group_sizes: the sizes sum to {total}, more than lhs's {m} rows")
    cfg = _Config(
        out_dtype=jnp.dtype(out_dtype),
        rhs_transposed=bool(rhs_transposed),
        num_local_groups=n_local,
        rhs_global=rhs_global,
        activation=activation,
        gated=gated,
        static_grid=False,
        quantized=quantization.is_quantized(rhs_dtype),
        mxfp4=is_mxfp4,
    )
    n_out = n // 2 if gated else n
    if m and n_out and k and n_local:
        kernels = _resolve_kernels(
            cfg, blocks, owner, m=m, k=k, rhs=rhs, lhs_dtype=lhs_dtype, has_row_scale=row_scale is not None
        )
        cfg = dataclasses.replace(cfg, kernels=kernels)
    return cfg, group_offset, n_out


def _info():
    return chip.current_tpu_info()


def _stored(rhs_shape, rhs_transposed):
    """Whether the kernel reads rhs swapped, and the orientation it then reads (see tuning.stored_minor_to_major_
    swapped): the swap is a bitcast of the weights as they sit in HBM, where the logical orientation would cost a
    relayout copy of all of them."""
    swapped = tuning.stored_minor_to_major_swapped(rhs_shape[1], rhs_shape[2])
    return swapped, rhs_transposed != swapped


def _as_stored(rhs, rhs_transposed):
    if _stored(rhs.shape, rhs_transposed)[0] and not mxfp4.is_mxfp4(rhs.dtype):
        return jnp.swapaxes(rhs, 1, 2), not rhs_transposed
    return rhs, rhs_transposed


def _fusable(gated, rhs_transposed, half_n, rhs_dtype) -> bool:
    """Whether the gate and up halves can be read as whole, aligned blocks of rhs (no copy of the weights)."""
    if gated is None:
        return True
    sub = sublane_multiple(rhs_dtype)
    if gated == "concatenated":
        # Gate/up blocks along N: lanes (multiples of 128) unless rhs is transposed (sublanes); the output block
        # (tm, tn) is legal for tn = half_n or a multiple of 128.
        return half_n % 128 == 0 if not rhs_transposed else half_n % sub == 0
    # Interleaved: one block of 2 tn alternating gate/up columns per output tile, de-interleaved in the epilogue
    # (kernel.py), in any orientation (a last partial block's columns past N are zeroed there).
    return True


def _has_epilogue(cfg: _Config) -> bool:
    return cfg.gated is not None or cfg.activation is not None


def _forward_mode(cfg: _Config, rhs_shape, rhs_dtype):
    """How the output is computed: ("plain", rhs_transposed) with no epilogue; ("unfused", rhs_transposed), the f32
    matmul then the epilogue in XLA, for gated layouts whose halves are not whole blocks; ("fused", rhs_transposed)
    otherwise. rhs_transposed is the orientation the kernel reads rhs in (its stored one where that is a bitcast
    and, when gated, keeps the halves whole blocks)."""
    swapped, stored_transposed = _stored(rhs_shape, cfg.rhs_transposed)
    if cfg.mxfp4:  # read as given: the kernel takes packed MXFP4 blocks [G, K / 2, N] only (ragged_dot converts)
        swapped, stored_transposed = False, cfg.rhs_transposed
    if not _has_epilogue(cfg):
        return "plain", stored_transposed
    half = (rhs_shape[1] if cfg.rhs_transposed else rhs_shape[2]) // 2
    if not _fusable(cfg.gated, cfg.rhs_transposed, half, rhs_dtype):
        return "unfused", stored_transposed
    if swapped and _fusable(cfg.gated, stored_transposed, half, rhs_dtype):
        return "fused", stored_transposed
    return "fused", cfg.rhs_transposed


def _resolve_kernels(cfg: _Config, blocks: RaggedDotBlocks, owner: str, *, m, k, rhs, lhs_dtype, has_row_scale):
    """The blocks of every kernel this call runs, forward and backward (the table's where `blocks` leaves them
    None). Resolved once, before tracing, so a bad tile fails here, named, whether or not a gradient is taken."""
    rhs_shape, rhs_dtype = tuple(rhs.shape), jnp.dtype(rhs.dtype)
    n_full = rhs_shape[1] if cfg.rhs_transposed else rhs_shape[2]
    common = dict(num_groups=cfg.num_local_groups, rhs_dtype=rhs_dtype, info=_info())
    if cfg.mxfp4:
        # The packed blocks are widened whole along K (one scale block per 32 of it): tk = K; and, unless given,
        # MXFP4_TN output columns a step, which bounds the widened bf16 planes in VMEM (four [K / 4, 2 tn] when gated).
        fixed = blocks.forward or MatmulBlocks()
        tn = fixed.tn if fixed.tn is not None else min(MXFP4_TN, n_full // 2 if cfg.gated else n_full)
        blocks = dataclasses.replace(blocks, forward=dataclasses.replace(fixed, tk=k, tn=tn))

    def plain(part, *, k, lhs_dtype, out_dtype, rhs_transposed):
        """A grouped matmul with no epilogue, rhs read in its stored orientation (as _plain_forward does)."""
        n = rhs_shape[1] if rhs_transposed else rhs_shape[2]
        return tuning.choose_blocks(
            m,
            k,
            n,
            lhs_dtype=lhs_dtype,
            out_dtype=out_dtype,
            rhs_transposed=_stored(rhs_shape, rhs_transposed)[1],
            fixed=getattr(blocks, part),
            owner=f"{owner}.{part}",
            **common,
        )

    mode, fused_transposed = _forward_mode(cfg, rhs_shape, rhs_dtype)
    if mode == "fused":
        n_out = n_full // 2 if cfg.gated else n_full
        forward = tuning.choose_blocks(
            m,
            k,
            n_out,
            lhs_dtype=lhs_dtype,
            out_dtype=cfg.out_dtype,
            rhs_transposed=fused_transposed,
            gated=cfg.gated is not None,
            half_n=n_out if cfg.gated == "concatenated" else None,
            fixed=blocks.forward,
            owner=f"{owner}.forward",
            **common,
        )
    else:
        out_dtype = cfg.out_dtype if mode == "plain" else jnp.dtype(jnp.float32)
        forward = plain("forward", k=k, lhs_dtype=lhs_dtype, out_dtype=out_dtype, rhs_transposed=cfg.rhs_transposed)
    if cfg.mxfp4:  # forward only
        return _Kernels(forward=forward, recompute=None, lhs_grad=None, rhs_grad=None)
    recompute = None
    if _has_epilogue(cfg) or has_row_scale:
        recompute = plain(
            "recompute", k=k, lhs_dtype=lhs_dtype, out_dtype=jnp.float32, rhs_transposed=cfg.rhs_transposed
        )
    # The backward's cotangent g [M, N]: f32 once the epilogue, the row scale or a quantized rhs's column scale has
    # been applied to it in XLA.
    g_dtype = jnp.dtype(jnp.float32) if recompute is not None or cfg.quantized else cfg.out_dtype
    lhs_grad = plain(
        "lhs_grad", k=n_full, lhs_dtype=g_dtype, out_dtype=lhs_dtype, rhs_transposed=not cfg.rhs_transposed
    )
    if cfg.quantized:  # constant weights: no rhs gradient kernel
        return _Kernels(forward=forward, recompute=recompute, lhs_grad=lhs_grad, rhs_grad=None)
    a_dtype, b_dtype = (g_dtype, lhs_dtype) if cfg.rhs_transposed else (lhs_dtype, g_dtype)
    p, q = (n_full, k) if cfg.rhs_transposed else (k, n_full)
    rhs_grad = tuning.choose_transposed_blocks(
        m,
        p,
        q,
        num_groups=cfg.num_local_groups,
        a_dtype=a_dtype,
        b_dtype=b_dtype,
        out_dtype=rhs_dtype,
        info=common["info"],
        fixed=blocks.rhs_grad,
        owner=f"{owner}.rhs_grad",
    )
    return _Kernels(forward=forward, recompute=recompute, lhs_grad=lhs_grad, rhs_grad=rhs_grad)


def _plain_forward(
    lhs,
    rhs,
    bias2d,
    scale2d,
    group_sizes,
    group_offset,
    *,
    blocks,
    out_dtype,
    rhs_transposed,
    n_local,
    rhs_global,
    static_grid,
    row_scale=None,
):
    """Grouped matmul (+ bias) with no epilogue, through the forward kernel, with resolved `blocks`."""
    rhs, rhs_transposed = _as_stored(rhs, rhs_transposed)
    bias = () if bias2d is None else (bias2d[:, None, :],)
    is_mxfp4 = mxfp4.is_mxfp4(rhs.dtype)
    scale = () if scale2d is None or is_mxfp4 else (scale2d[:, None, :],)
    return kernel.ragged_dot_forward(
        mxfp4.plane_order(lhs) if is_mxfp4 else lhs,
        rhs,
        group_sizes,
        out_dtype=out_dtype,
        blocks=blocks,
        rhs_transposed=rhs_transposed,
        group_offset=group_offset,
        num_local_groups=n_local,
        rhs_group_base=group_offset if rhs_global else 0,
        bias=bias,
        scale=scale,
        static_grid=static_grid,
        row_scale=_scale_column(row_scale),
        block_scale=scale2d if is_mxfp4 else None,
    )


def _scale_column(row_scale):
    return None if row_scale is None else row_scale.astype(jnp.float32)[:, None]


def _cfg_matmul(
    cfg: _Config, blocks, lhs, rhs, scale2d, bias2d, group_sizes, group_offset, *, out_dtype, row_scale=None
):
    """The call's grouped matmul (x column scale, + bias, x row scale) with no epilogue, in out_dtype."""
    return _plain_forward(
        lhs,
        rhs,
        bias2d,
        scale2d,
        group_sizes,
        group_offset,
        blocks=blocks,
        out_dtype=out_dtype,
        rhs_transposed=cfg.rhs_transposed,
        n_local=cfg.num_local_groups,
        rhs_global=cfg.rhs_global,
        static_grid=cfg.static_grid,
        row_scale=row_scale,
    )


def _halves(v2d, gated, half):
    """A per-column [G, N] array (bias, scale) as the fused kernel's per-stream [G, 1, N'] blocks."""
    if v2d is None:
        return ()
    if gated == "concatenated":
        return (v2d[:, None, :half], v2d[:, None, half:])
    return (v2d[:, None, :],)


def _fused_forward(cfg: _Config, lhs, rhs, scale2d, bias2d, row_scale, group_sizes, group_offset):
    blocks = cfg.kernels.forward
    mode, rhs_transposed = _forward_mode(cfg, rhs.shape, rhs.dtype)
    matmul = functools.partial(_cfg_matmul, cfg, blocks, lhs, rhs, scale2d, bias2d, group_sizes, group_offset)
    if mode == "plain":
        return matmul(out_dtype=cfg.out_dtype, row_scale=row_scale)
    if mode == "unfused":
        out = _epilogue(matmul(out_dtype=jnp.float32), cfg)
        if row_scale is not None:
            out = out * row_scale.astype(jnp.float32)[:, None]
        return out.astype(cfg.out_dtype)
    if rhs_transposed != cfg.rhs_transposed:  # read in the stored orientation: a bitcast of the weights
        rhs = jnp.swapaxes(rhs, 1, 2)
    half = (rhs.shape[1] if rhs_transposed else rhs.shape[2]) // 2
    return kernel.ragged_dot_forward(
        mxfp4.plane_order(lhs) if cfg.mxfp4 else lhs,
        rhs,
        group_sizes,
        out_dtype=cfg.out_dtype,
        blocks=blocks,
        rhs_transposed=rhs_transposed,
        group_offset=group_offset,
        num_local_groups=cfg.num_local_groups,
        rhs_group_base=group_offset if cfg.rhs_global else 0,
        bias=_halves(bias2d, cfg.gated, half),
        scale=() if cfg.mxfp4 else _halves(scale2d, cfg.gated, half),
        gated=cfg.gated,
        activation=cfg.activation,
        static_grid=cfg.static_grid,
        row_scale=_scale_column(row_scale),
        block_scale=scale2d if cfg.mxfp4 else None,
    )


def _epilogue(h, cfg: _Config):
    """act / act(gate) * up (or the ClampedSwiGLU) on the f32 pre-activation h [M, N] (rows outside the window are 0
    and stay 0: a ClampedSwiGLU's (0 + up_offset) * 0 * sigmoid(0) is 0 too)."""
    if cfg.gated is None:
        return apply_activation(h, cfg.activation)
    if cfg.gated == "concatenated":
        half = h.shape[1] // 2
        gate, up = h[:, :half], h[:, half:]
    else:
        gate, up = h[:, 0::2], h[:, 1::2]
    return apply_gating(gate, up, cfg.activation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_dot(cfg: _Config, lhs, rhs, scale2d, bias2d, row_scale, group_sizes, group_offset):
    return _fused_forward(cfg, lhs, rhs, scale2d, bias2d, row_scale, group_sizes, group_offset)


def _ragged_dot_fwd(cfg, lhs, rhs, scale2d, bias2d, row_scale, group_sizes, group_offset):
    out = _fused_forward(cfg, lhs, rhs, scale2d, bias2d, row_scale, group_sizes, group_offset)
    return out, (lhs, rhs, scale2d, bias2d, row_scale, group_sizes, group_offset)


def _group_rows(cfg: _Config, values2d, group_sizes, group_offset, m):
    """values2d [rhs groups, N] gathered per row of lhs: its group's row ([M, N]; rows outside the window get a
    valid row, which the kernels leave out anyway)."""
    local = metadata.local_group_of_rows(group_sizes, m, group_offset, cfg.num_local_groups)
    index = jnp.minimum(local, cfg.num_local_groups - 1) + (group_offset if cfg.rhs_global else 0)
    return values2d[index]


def _ragged_dot_bwd(cfg: _Config, saved, g):
    if cfg.mxfp4:
        raise NotImplementedError("ragged_dot: MXFP4 rhs is for inference; no gradient flows through it")
    lhs, rhs, scale2d, bias2d, row_scale, group_sizes, group_offset = saved
    m = lhs.shape[0]
    n_local = cfg.num_local_groups
    has_epilogue = _has_epilogue(cfg)
    d_row_scale = None
    if has_epilogue or row_scale is not None:
        # Recompute the pre-activation (f32); differentiate the row scale and the epilogue in XLA.
        h = _cfg_matmul(
            cfg, cfg.kernels.recompute, lhs, rhs, scale2d, bias2d, group_sizes, group_offset, out_dtype=jnp.float32
        )
        g = g.astype(jnp.float32)
        if row_scale is not None:
            unscaled = _epilogue(h, cfg) if has_epilogue else h
            d_row_scale = jnp.sum(g * unscaled, axis=1).astype(row_scale.dtype)
            g = g * row_scale.astype(jnp.float32)[:, None]
        if has_epilogue:
            _, epilogue_vjp = jax.vjp(lambda h: _epilogue(h, cfg), h)
            (g,) = epilogue_vjp(g)
    g_lhs = g
    if cfg.quantized:  # d lhs = (g * scale) @ q^T: the column scale moves onto the cotangent
        g_lhs = g.astype(jnp.float32) * _group_rows(cfg, scale2d, group_sizes, group_offset, m)
    # d lhs: the same grouped matmul against rhs read the other way round; rows outside the window get zero.
    dlhs = _plain_forward(
        g_lhs,
        rhs,
        None,
        None,
        group_sizes,
        group_offset,
        blocks=cfg.kernels.lhs_grad,
        out_dtype=lhs.dtype,
        rhs_transposed=not cfg.rhs_transposed,
        n_local=n_local,
        rhs_global=cfg.rhs_global,
        static_grid=cfg.static_grid,
    )
    # d rhs: per group, lhs[rows]^T @ g[rows] ([K, N]), or g[rows]^T @ lhs[rows] for the transposed layout. A
    # quantized rhs and its scale are constants (None: a zero cotangent).
    drhs = None
    if not cfg.quantized:
        a, b = (g, lhs) if cfg.rhs_transposed else (lhs, g)
        drhs = kernel.transposed_ragged_dot(
            a,
            b,
            group_sizes,
            out_dtype=rhs.dtype,
            blocks=cfg.kernels.rhs_grad,
            group_offset=group_offset,
            num_local_groups=n_local,
            static_grid=cfg.static_grid,
        )
    dbias = None
    if bias2d is not None:
        local = metadata.local_group_of_rows(group_sizes, m, group_offset, n_local)
        dbias = jax.ops.segment_sum(g.astype(jnp.float32), local, num_segments=n_local + 1)[:n_local]
        dbias = dbias.astype(bias2d.dtype)
    if cfg.rhs_global:
        start = jnp.asarray(group_offset, jnp.int32)
        if drhs is not None:
            drhs = jax.lax.dynamic_update_slice(jnp.zeros(rhs.shape, rhs.dtype), drhs, (start, 0, 0))
        if dbias is not None:
            dbias = jax.lax.dynamic_update_slice(jnp.zeros(bias2d.shape, bias2d.dtype), dbias, (start, 0))
    dlhs, drhs, dbias, d_row_scale = cotangents_like((dlhs, drhs, dbias, d_row_scale), (lhs, rhs, bias2d, row_scale))
    return dlhs, drhs, None, dbias, d_row_scale, None, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _no_contraction(cfg: _Config, m, n_full, bias, row_scale, group_sizes, group_offset):
    """K = 0: each row of a local group is its group's bias (zero without one) through the epilogue, scaled; every
    other row is zero. Plain XLA: there is no matmul to run."""
    local = metadata.local_group_of_rows(group_sizes, m, group_offset, cfg.num_local_groups)
    in_window = local < cfg.num_local_groups
    if bias is None:
        pre = jnp.zeros((m, n_full), jnp.float32)
    else:
        index = jnp.minimum(local, cfg.num_local_groups - 1) + (group_offset if cfg.rhs_global else 0)
        pre = jnp.where(in_window[:, None], bias.astype(jnp.float32)[index], 0.0)
    out = _epilogue(pre, cfg)
    if row_scale is not None:
        out = out * row_scale.astype(jnp.float32)[:, None]
    return jnp.where(in_window[:, None], out, 0.0).astype(cfg.out_dtype)


@interpret_eager_cpu_calls
def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    rhs_transposed: bool = False,
    group_offset=0,
    num_local_groups: int | None = None,
    bias: jax.Array | None = None,
    activation: str | None = None,
    gated: str | None = None,
    row_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    static_grid: bool = False,
    blocks: RaggedDotBlocks | None = None,
) -> jax.Array:
    """Grouped matmul with `jax.lax.ragged_dot` semantics, an optional local group window and fused epilogue.

    lhs [M, K] (f32/bf16), rows sorted by group; rhs [R, K, N] or [R, N, K] (rhs_transposed) (f32/bf16, or int8 /
    float8_e4m3fn with rhs_scale [R, N] f32: w = rhs * scale per output column), R = G or num_local_groups;
    group_sizes [G] int32. Returns [M, N] (or [M, N/2] when gated) in preferred_element_type or the promoted input
    dtype (lhs's against quantized rhs). row_scale [M] (f32/bf16) multiplies each output row last. See the module
    docstring for the window, the epilogue, quantized rhs and what is checked when.
    `static_grid=True` sizes the kernel grid by the worst-case visit count instead of the real one (for comparison).
    `blocks`: the tiles of the forward kernel and of the backward's three (a RaggedDotBlocks); None: the table's.
    MXFP4 rhs (inference): uint8 blocks [R, N, K / 2] or [R, N, K / 32, 16] with rhs_transposed=True and rhs_scale
    uint8 [R, N, K / 32] (e8m0, the checkpoint's layout; see common/mxfp4.py), or as `mxfp4.prepare` lays them out
    once, [R, K / 2, N] with rhs_scale [R, scale_rows(K), N] and rhs_transposed=False (no copy of them a call).
    """
    if hasattr(rhs, "dtype") and mxfp4.is_mxfp4(rhs.dtype):
        rhs = mxfp4.packed("rhs", rhs)
    checks = dict(
        preferred_element_type=preferred_element_type,
        num_local_groups=num_local_groups,
        bias=bias,
        activation=activation,
        gated=gated,
        row_scale=row_scale,
        blocks=blocks,
    )
    cfg, group_offset, n_out = check_inputs(
        lhs, rhs, group_sizes, rhs_transposed=rhs_transposed, group_offset=group_offset, rhs_scale=rhs_scale, **checks
    )
    if cfg.mxfp4 and cfg.rhs_transposed:  # the checkpoint's orientation: converted here, on every call
        rhs, rhs_scale = mxfp4.prepare(rhs, rhs_scale)
        cfg, group_offset, n_out = check_inputs(
            lhs, rhs, group_sizes, group_offset=group_offset, rhs_scale=rhs_scale, **checks
        )
    cfg = dataclasses.replace(cfg, static_grid=check_bool("static_grid", static_grid))
    m, k = lhs.shape
    if m == 0 or n_out == 0:
        return jnp.zeros((m, n_out), cfg.out_dtype)
    if cfg.num_local_groups == 0:
        return jnp.zeros((m, n_out), cfg.out_dtype)
    if k == 0:
        n_full = rhs.shape[1] if cfg.rhs_transposed else rhs.shape[2]
        return _no_contraction(cfg, m, n_full, bias, row_scale, group_sizes, group_offset)
    return _ragged_dot(cfg, lhs, rhs, rhs_scale, bias, row_scale, group_sizes, group_offset)


def candidate_blocks(lhs, rhs, group_sizes, **kwargs) -> list[RaggedDotBlocks]:
    """Forward tilings worth modeling for this call of ragged_dot (same arguments; arrays or ShapeDtypeStructs),
    the table's choice first (tuning.candidate_blocks at the forward kernel's shape), each as a `blocks=` value."""
    kwargs.pop("blocks", None)
    kwargs.pop("static_grid", None)
    if hasattr(rhs, "dtype") and mxfp4.is_mxfp4(rhs.dtype):
        return _mxfp4_candidate_blocks(lhs, rhs, group_sizes, **kwargs)
    cfg, _, n_out = check_inputs(lhs, rhs, group_sizes, **kwargs)
    if cfg.kernels is None:
        return [RaggedDotBlocks()]
    m, k = lhs.shape
    rhs_shape = tuple(rhs.shape)
    mode, rhs_transposed = _forward_mode(cfg, rhs_shape, rhs.dtype)
    n_full = rhs_shape[1] if cfg.rhs_transposed else rhs_shape[2]
    gated = mode == "fused" and cfg.gated is not None
    forwards = tuning.candidate_blocks(
        m,
        k,
        n_out if mode == "fused" else n_full,
        num_groups=cfg.num_local_groups,
        lhs_dtype=lhs.dtype,
        rhs_dtype=rhs.dtype,
        out_dtype=cfg.out_dtype if mode != "unfused" else jnp.float32,
        rhs_transposed=rhs_transposed,
        gated=gated,
        half_n=n_out if gated and cfg.gated == "concatenated" else None,
        info=_info(),
    )
    return [RaggedDotBlocks(forward=f) for f in forwards]


def _mxfp4_candidate_blocks(lhs, rhs, group_sizes, **kwargs) -> list[RaggedDotBlocks]:
    """candidate_blocks for MXFP4 rhs: the forward kernel as it reads the weights (mxfp4.prepare's [R, K / 2, N],
    whatever orientation the call gives them in) with tk = K, as the call resolves it: the table's choice (tn =
    MXFP4_TN unless N is narrower), then tm halved and doubled and the next narrower and wider tn, each resolved
    through blocks= as the call would and kept where it is legal and distinct."""
    shape = tuple(rhs.shape)
    if len(shape) == 4 and shape[-1] == 16:  # transformers' [R, N, K / 32, 16]
        shape = (*shape[:2], shape[2] * 16)
    rhs = jax.ShapeDtypeStruct(shape, rhs.dtype)
    cfg, _, _ = check_inputs(lhs, rhs, group_sizes, **kwargs)
    if cfg.rhs_transposed:  # the checkpoint's orientation: the call prepares it, so tile the prepared layout
        g, n, half_k = shape
        rhs = jax.ShapeDtypeStruct((g, half_k, n), rhs.dtype)
        scale = jax.ShapeDtypeStruct((g, mxfp4.scale_rows(2 * half_k), n), mxfp4.SCALE_DTYPE)
        kwargs = dict(kwargs, rhs_transposed=False, rhs_scale=scale)
        cfg, _, _ = check_inputs(lhs, rhs, group_sizes, **kwargs)
    m, k = lhs.shape

    def resolved(forward):
        blocks = RaggedDotBlocks(forward=forward)
        has_row_scale = kwargs.get("row_scale") is not None
        return _resolve_kernels(
            cfg, blocks, "blocks", m=m, k=k, rhs=rhs, lhs_dtype=jnp.dtype(lhs.dtype), has_row_scale=has_row_scale
        ).forward

    table = resolved(None)
    n_full = rhs.shape[2]
    n_out = n_full // 2 if cfg.gated else n_full
    tn_options = tuning.tn_options(
        n_out, _info(), cfg.gated is not None, n_out if cfg.gated == "concatenated" else None
    )
    at = tn_options.index(table.tn) if table.tn in tn_options else 0
    moves = [MatmulBlocks(tm=table.tm // 2, tn=table.tn), MatmulBlocks(tm=table.tm * 2, tn=table.tn)]
    moves += [MatmulBlocks(tm=table.tm, tn=tn_options[i]) for i in (at - 1, at + 1) if 0 <= i < len(tn_options)]
    candidates = [table]
    for move in moves:
        try:
            candidate = resolved(move)
        except (TypeError, ValueError):  # not a legal tile here, or too large for VMEM
            continue
        if candidate not in candidates:
            candidates.append(candidate)
    return [RaggedDotBlocks(forward=f) for f in candidates]
