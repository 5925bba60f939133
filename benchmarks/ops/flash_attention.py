"""Flash attention, forward and backward, against XLA's plain attention and the TPU attention kernels users have:
JAX's Pallas flash attention, JAX's splash attention and tokamax's Mosaic TPU attention.

Shapes (benchmarks/shapes.py, FLASH_ATTENTION): flash-attn's layouts in bf16. "dense" is q [B, S, Hq, D],
k/v [B, S, Hkv, D] with B = 32768 // S; "varlen" packs the same 32768 tokens as sequences of mixed lengths (uniform
in [S/4, 7S/4], mean S, fixed seed; `varlen_lengths`) as q [T, Hq, D] with int32 cu_seqlens and max_seqlen the real
longest. Qwen3 scales by D^-0.5, Gemma 4 by 1.0; Gemma's sliding window 1024 is window_size (1023, 0), causal. Gemma 4's
full layers share K and V (K = V); here v is a separate array (no implementation could exploit it from the API).

Ops. `forward`: out = attention(q, k, v). `backward`: (dq, dk, dv) = the vjp of each implementation's own forward
(jax.vjp, as training calls it) at a cotangent, with the forward's residuals as program inputs: the residuals every
implementation saves are traced once (`residual_specs`) and fed in, so the program holds the backward alone (the
forward is dead code XLA removes), as flash-attn times its backward. XLA's default saves nothing: it runs under
jax.checkpoint and recomputes its scores in the backward (saving them would take B * Hq * S^2 f32 of HBM), as the flash
kernels recompute theirs.

Roofline: the MXU flops of the kept scores only (causal: the lower triangle; a window: its band; varlen: within each
sequence): forward 2 * kept * (D + Dv) per query head (two matmuls), backward 2 * kept * (3 D + 2 Dv) (five: the score
recompute, dp = do v^T, dv, dq, dk; flash-attn's 2.5x the forward), or the HBM bytes if those take longer. The table's
TFLOP/s and % of MXU peak count those kept-score flops over the modeled time (`flops_columns`), and the chart plots
TFLOP/s against the sequence length (varlen: the mean length).

Implementations (all compiled by the same compiler in the same run, modeled on one TensorCore). On v5e / v6e the
flash-attn layout costs every baseline a relayout of q and of the output in XLA (the (8, 128) tiles of [.., H, D] are
not those of the [T, H * D] or [H, S, D] views the kernels take): 2 x 409 µs at Qwen3's 32768 tokens on v6e. Ours
takes q and the output as they lie where a step's query heads are a multiple of 8 (Qwen3, Gemma 4 full) and pays
only K/V's relayout there (docs/flash_attention.md, Layout); its fused backward there takes o and do and writes dq
as they lie (q is a residual its forward's differentiation rule saves merged, so no copy of it is in the backward).
- default: XLA attention, the plain jnp composition: bf16 matmuls with f32 scores and softmax. It materialises the
  scores, so it runs per chunk of sequences and query rows with at most 2^30 scores each (the whole batch's scores
  would not fit HBM from S = 8192); varlen: per sequence, with the lengths known at trace time. With a mask XLA
  materialises the broadcast mask and its estimate is 5-7x the unmasked one (jax.nn.dot_product_attention's XLA path
  compiles to the same).
- jax_flash: jax.experimental.pallas.ops.tpu.flash_attention, layout [B, H, S, D]: q, k, v are transposed into it and
  the output back, and K/V are repeated to every query head (it has no GQA); those XLA copies are in its time. Causal
  only (no window); varlen as one packed sequence with segment ids. Tiles 512 (or the sequence length).
- splash: jax.experimental.pallas.ops.tpu.splash_attention, make_splash_mqa per kv head (its GQA), vmapped over the
  batch and the kv heads, [H, S, D] per sequence (transposed in and out), q pre-scaled; causal, local-window or full
  masks; varlen as one packed sequence with segment ids. Tiles 1024 (kv compute 512), or the sequence length.
- tokamax: tokamax.dot_product_attention with its Mosaic TPU implementation (a splash fork), at the tiles tokamax's
  own TPU7x autotuning data picked for the nearest shape it has (same causality, nearest head dim and length): it
  ships no v6e or v5e data, and its heuristic default (128 tiles) models 12x slower at Qwen3's causal seq 4096.
  Not for sliding windows or packed sequences (it rejects k_start/k_end and has no segment ids).

Targets, on the modeled v6e figures: forward >= 50 % of MXU peak at S >= 4096 for head dim 128, >= 65 % for head dims
256 and 512 (no mask); causal forwards (windowed included) >= 45 % of peak on their kept scores; backward >= 40 % at
S >= 4096; at least 1.1x splash attention and faster than XLA at every shape, forward and backward.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax.common import chip
from tpu_kernels_jax.flash_attention import api, schedule, tuning

from .. import inputs, shapes
from ..device_timing import reason
from ..suite import BASELINE_PREFIX, Baseline, Op, PartialInputs, Suite, Targets

BF16 = jnp.bfloat16
TOKENS = shapes.FLASH_ATTENTION_TOKENS
# Scale of each model's attention (None: D^-0.5).
SCALE = {
    "qwen3-30b-a3b": None,
    "gemma4-sliding": 1.0,
    "gemma4-full": 1.0,
    "gpt-oss-sliding": None,
    "gpt-oss-full": None,
}
# Most scores one chunk of XLA's plain attention materialises (f32): 4 GiB.
XLA_MAX_SCORES = 1 << 30
JAX_FLASH_TILE = 512
# Longest tuned entry tokamax's configs are scaled from past its data's widest head dim (see _tokamax_best).
TOKAMAX_SCALED_MAX_SEQ = 4096
SPLASH_TILE, SPLASH_COMPUTE_TILE = 1024, 512

MXU_TARGETS = {128: 0.50, 256: 0.65, 512: 0.65}  # forward, no mask, by head dim
CAUSAL_TARGET, BACKWARD_TARGET, TARGET_FROM_SEQ = 0.45, 0.40, 4096
MIN_SPLASH_SPEEDUP = 1.1
GOAL = (
    f"forward >= {MXU_TARGETS[128]:.0%} of MXU peak at seq >= {TARGET_FROM_SEQ} for head dim 128 and "
    f">= {MXU_TARGETS[256]:.0%} for 256 and 512 (no mask), causal >= {CAUSAL_TARGET:.0%} on its kept scores; "
    f"backward >= {BACKWARD_TARGET:.0%} at seq >= {TARGET_FROM_SEQ}; >= {MIN_SPLASH_SPEEDUP}x splash attention and "
    "faster than XLA at every shape"
)


@dataclasses.dataclass(frozen=True)
class Config:
    """The static options of one shape's call (bound to every implementation; picklable by reference)."""

    layout: str  # "dense" | "varlen"
    causal: bool
    window: tuple[int, int]  # flash-attn's window_size
    scale: float | None
    lengths: tuple[int, ...]  # the sequence lengths (dense: B equal ones)
    sinks: bool = False  # a sink logit per query head joins every row's softmax (gpt-oss; the values: sinks())

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)


# ------------------------------------------------------------------------------------------------- shapes, sizes
def varlen_lengths(seq: int, tokens: int = TOKENS) -> tuple[int, ...]:
    """tokens // seq lengths drawn uniformly from [seq / 4, 7 seq / 4] (seed: seq), moved by equal shares so that
    they sum to `tokens` exactly; mean seq."""
    n = tokens // seq
    rng = np.random.default_rng(seq)
    lengths = rng.integers(seq // 4, 7 * seq // 4 + 1, n)
    short = tokens - int(lengths.sum())
    lengths += short // n
    lengths[: short % n] += 1
    assert lengths.sum() == tokens and lengths.min() > 0
    return tuple(int(x) for x in lengths)


def config(s) -> Config:
    window = (s["window"] - 1, 0) if s["window"] > 0 else (-1, -1)
    if s["layout"] == "dense":
        lengths = (s.batch,) * (TOKENS // s.batch)
    else:
        lengths = varlen_lengths(s.batch)
    sinks = s["model"] in shapes.FLASH_ATTENTION_SINKS
    return Config(s["layout"], s["mask"] == "causal", window, SCALE[s["model"]], lengths, sinks)


def sinks(q_heads: int):
    """The sink logits of a model with sinks, the same for every implementation: fixed values of a learned
    parameter's scale (N(0, 1), seeded by the head count), a constant of each program (their gradient, one number a
    head, is left out of the backward)."""
    return jnp.asarray(np.random.default_rng(q_heads).normal(size=q_heads), jnp.float32)


def _inputs(s):
    """(q, k, v) specs, and for varlen the int32 cu_seqlens (q, k)."""
    cfg = config(s)
    heads = {"q": s["q_heads"], "k": s["kv_heads"], "v": s["kv_heads"]}
    if cfg.layout == "dense":
        batch = len(cfg.lengths)
        qkv = tuple(jax.ShapeDtypeStruct((batch, s.batch, h, s["head_dim"]), BF16) for h in heads.values())
        return qkv
    qkv = tuple(jax.ShapeDtypeStruct((TOKENS, h, s["head_dim"]), BF16) for h in heads.values())
    cu = jax.ShapeDtypeStruct((len(cfg.lengths) + 1,), jnp.int32)
    return (*qkv, cu, cu)


def _cu_seqlens(cfg: Config):
    return jnp.asarray(np.concatenate([[0], np.cumsum(cfg.lengths)]).astype(np.int32))


def _concrete_cu(s, args):
    """args with the varlen cu_seqlens concrete (the kernel's visit list and every mask follow them)."""
    if config(s).layout == "dense":
        return args
    cu = _cu_seqlens(config(s))
    return (*args[:3], cu, cu, *args[5:])


def kept_scores(cfg: Config) -> int:
    """Query-key pairs of the kept scores over every sequence (and one head)."""
    left, right = cfg.window
    total = 0
    for length in set(cfg.lengths):
        i = np.arange(length, dtype=np.int64)
        lo = np.maximum(i - left, 0) if left >= 0 else np.zeros_like(i)
        hi = i if cfg.causal else (np.minimum(i + right, length - 1) if right >= 0 else np.full_like(i, length - 1))
        total += int((hi - lo + 1).sum()) * cfg.lengths.count(length)
    return total


def _flops(op, s):
    d = dv = s["head_dim"]
    per_pair = (d + dv) if op == "forward" else (3 * d + 2 * dv)
    return 2 * kept_scores(config(s)) * per_pair * s["q_heads"]


def _hbm_bytes(op, s):
    """forward: q, k, v read, out written; backward: q, k, v, out, do and the lse read, dq, dk, dv written."""
    q, k, v = (math.prod(x.shape) * 2 for x in _inputs(s)[:3])
    if op == "forward":
        return q + k + v + q
    return 2 * (q + k + v) + 2 * q + TOKENS * s["q_heads"] * 4


# ------------------------------------------------------------------------------------------- forward functions
def kernel_forward(q, k, v, *cu, cfg: Config, blocks=None):
    options = dict(softmax_scale=cfg.scale, causal=cfg.causal, window_size=cfg.window, blocks=blocks)
    if cfg.sinks:
        options["sinks"] = sinks(q.shape[-2])
    if cfg.layout == "dense":
        return api.flash_attention(q, k, v, **options)
    return api.flash_attention_varlen(q, k, v, *cu, cfg.max_seqlen, cfg.max_seqlen, **options)


def _xla_attention(q, k, v, cfg: Config, row0: int):
    """Plain attention of query rows row0.. of equal-length sequences: q [b, r, Hq, D], k/v [b, S, Hkv, D]."""
    b, rows, hq, d = q.shape
    seq, hkv = k.shape[1], k.shape[2]
    scale = d**-0.5 if cfg.scale is None else cfg.scale
    qg = q.reshape(b, rows, hkv, hq // hkv, d)
    scores = jnp.einsum("brhgd,bshd->bhgrs", qg, k, preferred_element_type=jnp.float32) * scale
    row = row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, seq), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, seq), 1)
    left, right = cfg.window
    keep = jnp.ones((rows, seq), bool)
    if left >= 0:
        keep &= col >= row - left
    if cfg.causal:
        keep &= col <= row
    elif right >= 0:
        keep &= col <= row + right
    scores = jnp.where(keep, scores, -jnp.inf)
    if cfg.sinks:  # one more logit in each row's softmax, which weighs no value
        sink = jnp.broadcast_to(sinks(hq).reshape(1, hkv, hq // hkv, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgrs,bshd->brhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, rows, hq, v.shape[-1]).astype(q.dtype)


def _xla_chunked(q, k, v, cfg: Config):
    """_xla_attention over chunks of sequences, and of query rows when one sequence's scores exceed the budget."""
    batch, seq, hq, _ = q.shape
    per_seq = hq * seq * seq
    if per_seq <= XLA_MAX_SCORES:
        step = max(1, XLA_MAX_SCORES // per_seq)
        parts = [
            _xla_attention(q[i : i + step], k[i : i + step], v[i : i + step], cfg, 0) for i in range(0, batch, step)
        ]
        return jnp.concatenate(parts, axis=0)
    rows = max(128, XLA_MAX_SCORES // (hq * seq))
    parts = [
        jnp.concatenate(
            [
                _xla_attention(q[i : i + 1, r : r + rows], k[i : i + 1], v[i : i + 1], cfg, r)
                for r in range(0, seq, rows)
            ],
            axis=1,
        )
        for i in range(batch)
    ]
    return jnp.concatenate(parts, axis=0)


def xla_forward(q, k, v, *cu, cfg: Config):
    if cfg.layout == "dense":
        return _xla_chunked(q, k, v, cfg)
    starts = np.concatenate([[0], np.cumsum(cfg.lengths)])
    outs = [_xla_chunked(q[None, a:b], k[None, a:b], v[None, a:b], cfg)[0] for a, b in zip(starts[:-1], starts[1:])]
    return jnp.concatenate(outs, axis=0)


def _checkpointed_xla_forward(q, k, v, *cu, cfg: Config):
    return jax.checkpoint(functools.partial(xla_forward, cfg=cfg))(q, k, v, *cu)


def _segment_ids(cu, tokens):
    return (jnp.searchsorted(cu, jnp.arange(tokens, dtype=jnp.int32), side="right") - 1).astype(jnp.int32)


def _packed(q, k, v, cu, cfg):
    """Both layouts as [B, S, H, D] with segment ids for varlen (one packed sequence; None for dense)."""
    if cfg.layout == "dense":
        return q, k, v, None
    return q[None], k[None], v[None], _segment_ids(cu[0], q.shape[0])


def _unpacked(out, cfg):
    return out if cfg.layout == "dense" else out[0]


def jax_flash_forward(q, k, v, *cu, cfg: Config):
    from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

    q, k, v, segments = _packed(q, k, v, cu, cfg)
    seq, hq, d = q.shape[1], q.shape[2], q.shape[3]
    group = hq // k.shape[2]
    tile = min(JAX_FLASH_TILE, seq)
    blocks = jax_flash.BlockSizes(
        **dict.fromkeys(("block_q", "block_k_major", "block_k"), tile),
        block_b=1,
        **dict.fromkeys(("block_q_major_dkv", "block_k_major_dkv", "block_k_dkv", "block_q_dkv"), tile),
        **dict.fromkeys(("block_k_major_dq", "block_k_dq", "block_q_dq"), tile),
    )
    heads_major = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    out = jax_flash.flash_attention(
        heads_major(q),
        heads_major(jnp.repeat(k, group, axis=2)),
        heads_major(jnp.repeat(v, group, axis=2)),
        segment_ids=None if segments is None else jax_flash.SegmentIds(segments[None], segments[None]),
        causal=cfg.causal,
        sm_scale=d**-0.5 if cfg.scale is None else cfg.scale,
        block_sizes=blocks,
    )
    return _unpacked(heads_major(out), cfg)


def _splash_mask(seq, cfg: Config, group: int):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    left, right = cfg.window
    if left >= 0:
        mask = splash.LocalMask((seq, seq), (left, 0 if cfg.causal else right), offset=0)
    elif cfg.causal:
        mask = splash.CausalMask((seq, seq))
    else:
        mask = splash.FullMask((seq, seq))
    return splash.MultiHeadMask([mask] * group)


def splash_forward(q, k, v, *cu, cfg: Config):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    q, k, v, segments = _packed(q, k, v, cu, cfg)
    batch, seq, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    tile, compute = min(SPLASH_TILE, seq), min(SPLASH_COMPUTE_TILE, seq)
    blocks = splash.BlockSizes(
        block_q=tile,
        block_kv=tile,
        block_kv_compute=compute,
        block_q_dkv=tile,
        block_kv_dkv=tile,
        block_kv_dkv_compute=compute,
        block_q_dq=tile,
        block_kv_dq=tile,
    )
    kernel = splash.make_splash_mqa_single_device(_splash_mask(seq, cfg, group), block_sizes=blocks)
    scale = d**-0.5 if cfg.scale is None else cfg.scale
    if scale != 1.0:
        q = (q * scale).astype(q.dtype)  # splash takes the scale folded into q
    qh = q.reshape(batch, seq, hkv, group, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, group, S, D]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, S, D]
    # each kv head's query heads' sinks ([Hkv, group]: splash's MQA kernel takes one kv head's group)
    head_sinks = sinks(hq).reshape(hkv, group) if cfg.sinks else jnp.zeros((hkv, 0), jnp.float32)
    ids = None if segments is None else splash.SegmentIds(q=segments, kv=segments)

    def per_head(q1, k1, v1, s1):
        return kernel(q1, k1, v1, segment_ids=ids, sinks=s1 if cfg.sinks else None)

    out = jax.vmap(jax.vmap(per_head), in_axes=(0, 0, 0, None))(qh, kh, vh, head_sinks)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, hq, v.shape[-1])
    return _unpacked(out, cfg)


def _tokamax():
    """tokamax, imported lazily (a benchmarks-only dependency); it reads absl flags, which must never parse the
    benchmark's own command line."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    import tokamax

    return tokamax


@functools.cache
def _tokamax_table(name: str) -> tuple:
    """tokamax's installed TPU7x autotuning results: ((key, best config), ...)."""
    path = pathlib.Path(_tokamax().__file__).parent / "data" / "autotuning" / "tpu7x" / f"{name}.json"
    out = []
    for key, results in json.loads(path.read_text()).items():
        if results:
            best = min(results.items(), key=lambda kv: min(kv[1]["evaluation_times_ms"]))[0]
            out.append((json.loads(key), json.loads(best)))
    return tuple(out)


def _tokamax_best(name: str, seq: int, head_dim: int, causal: bool) -> dict:
    """The config tokamax's autotuning chose for its entry nearest this call (same causality; nearest head dim,
    then nearest sequence length on a log scale; forward entries without residuals), its tiles clipped to the
    sequence and, past the data's widest head dim (256), shrunk by the head dims' ratio (the same VMEM a step).

    Past the widest head dim only entries up to TOKAMAX_SCALED_MAX_SEQ are taken: the longer ones were tuned to
    4096-wide tiles, which even shrunk need more scoped VMEM a step than v6e's 32 MiB default (36.7 MiB for the
    unmasked forward at head dim 512), and tokamax sets no VMEM limit of its own."""

    def dims(key):
        batch_seq_heads_dim = key["q"].split("[")[1].rstrip("]").split(",")
        return int(batch_seq_heads_dim[1]), int(batch_seq_heads_dim[3])

    entries = [(k, c) for k, c in _tokamax_table(name) if k["mask"]["is_causal"] == causal]
    if name.endswith("attention"):
        entries = [(k, c) for k, c in entries if not k["return_residuals"]]
    if head_dim > max(dims(k)[1] for k, _ in entries):
        entries = [(k, c) for k, c in entries if dims(k)[0] <= TOKAMAX_SCALED_MAX_SEQ]
    key, best = min(
        entries, key=lambda e: (abs(math.log2(dims(e[0])[1] / head_dim)), abs(math.log2(dims(e[0])[0] / seq)))
    )
    shrink = max(1, head_dim // dims(key)[1])
    best = dict(best)
    tiles = [k for k in best if k.startswith("block_")]
    for k in tiles:
        best[k] = min(seq, best[k] if k.endswith("_compute") else max(128, best[k] // shrink))
    for k in tiles:  # a compute tile divides its block
        if k.endswith("_compute"):
            best[k] = min(best[k], best[k.removesuffix("_compute")])
    return best


def _tokamax_op(seq: int, head_dim: int, causal: bool):
    _tokamax()
    from tokamax._src.ops.attention import pallas_mosaic_tpu as mosaic
    from tokamax._src.ops.attention import pallas_mosaic_tpu_vjp as mosaic_vjp

    fwd = _tokamax_best("pallas_mosaic_tpu_flash_attention", seq, head_dim, causal)
    vjp = _tokamax_best("pallas_mosaic_tpu_flash_attention_vjp", seq, head_dim, causal)
    return mosaic.PallasMosaicTpuFlashAttention(
        config=mosaic.Config(**fwd), vjp=mosaic_vjp.PallasMosaicTpuFlashAttentionVjp(config=mosaic_vjp.Config(**vjp))
    )


def tokamax_forward(q, k, v, *cu, cfg: Config):
    implementation = _tokamax_op(q.shape[1], q.shape[3], cfg.causal)
    return _tokamax().dot_product_attention(
        q, k, v, scale=cfg.scale, is_causal=cfg.causal, implementation=implementation
    )


# ------------------------------------------------------------------------------------------------- the backward
# The backward of an implementation: jax.vjp of its forward, with every floating-point residual the vjp closes over
# (a value computed from q, k, v) replaced by a program input. Integer residuals (the kernel's visit lists, segment
# ids) stay computed in the program from cu_seqlens, which the model sees concrete.
def _is_residual(x) -> bool:
    return isinstance(x, jax.core.Tracer) and jnp.issubdtype(x.dtype, jnp.floating)


def _vjp(forward, args):
    q, k, v, *cu = args
    return jax.vjp(lambda q, k, v: forward(q, k, v, *cu), q, k, v)[1]


def _residuals(forward, *args):
    return [x for x in jax.tree.leaves(_vjp(forward, args)) if _is_residual(x)]


def _backward(forward, impl, *args, cfg: Config, **options):
    """(dq, dk, dv) from args = (*inputs, do, {impl: residuals}): this implementation's residuals only."""
    *inputs, do, residuals = args
    vjp = _vjp(functools.partial(forward, cfg=cfg, **options), inputs)
    leaves, tree = jax.tree.flatten(vjp)
    given = iter(residuals[impl])
    leaves = [next(given) if _is_residual(x) else x for x in leaves]
    return jax.tree.unflatten(tree, leaves)(do)


FORWARDS_OF_OWN = ("kernel", "default")  # FORWARDS' names that are the suite's own; the others are baselines
FORWARDS = {
    "kernel": kernel_forward,
    "default": _checkpointed_xla_forward,
    "jax_flash": jax_flash_forward,
    "splash": splash_forward,
    "tokamax": tokamax_forward,
}


def _unsupported(impl, s) -> str | None:
    with_sinks = s["model"] in shapes.FLASH_ATTENTION_SINKS
    if impl == "jax_flash" and s["window"] > 0:
        return "JAX's flash attention has no sliding window"
    if impl == "jax_flash" and with_sinks:
        return "JAX's flash attention has no sinks"
    if impl == "tokamax":
        if s["window"] > 0 or s["layout"] == "varlen":
            return "tokamax's Mosaic TPU attention rejects sliding windows and packed sequences (k_start / k_end)"
        if with_sinks:
            return "tokamax's attention has no sinks"
        try:
            _tokamax()
        except ImportError as e:
            return f"tokamax not installed ({e}); it is in the `bench` extra of pyproject.toml"
    return None


def _forward_of(impl, cfg: Config, blocks=None):
    """impl's forward for cfg; the kernel's at `blocks` (None: its table's)."""
    options = {"blocks": blocks} if impl == "kernel" and blocks is not None else {}
    return functools.partial(FORWARDS[impl], cfg=cfg, **options)


def _residuals_program(impl, cfg: Config, blocks=None):
    """impl's forward as a program that returns its residuals (jitted on its own: traced inside another program, its
    residuals are still those the backward's program, which traces the forward the same way, expects)."""
    return jax.jit(functools.partial(_residuals, _forward_of(impl, cfg, blocks)))


def residual_specs(s, impls=None, blocks=None) -> dict:
    """{impl: [residual specs]} of every implementation that applies to shape s (or of those of `impls`); the
    kernel's from its forward at `blocks` (its output and lse are laid out by the forward's kv heads a step)."""
    return _residual_specs(s, None if impls is None else tuple(impls), blocks)


@functools.cache
def _residual_specs(s, impls, blocks) -> dict:
    from .. import perf_model

    cfg = config(s)
    out = {}
    # traced as for a TPU (tokamax refuses other devices); the residuals' shapes do not depend on the generation
    device = perf_model.trace_device("v6e")
    with jax.default_device(device) if device is not None else contextlib.nullcontext():
        for impl in FORWARDS if impls is None else impls:
            if _unsupported(impl, s) is None:
                out[impl] = jax.eval_shape(_residuals_program(impl, cfg, blocks), *_inputs(s))
    return out


def _specs(op, s, blocks=None, impls=None):
    """The op's argument specs; the backward's residuals those of `impls` (default: every implementation that
    applies), the kernel's at `blocks` (op.tiling_inputs)."""
    inputs = _inputs(s)
    if op == "forward":
        return inputs
    return (*inputs, inputs[0], residual_specs(s, impls, blocks))


def _arrays(op, s, seed, blocks=None, impls=None):
    """Random q, k, v (and do) made on the device; for the backward each implementation's residuals (those of
    `impls`, default every one that applies) from its own forward on them, the kernel's at `blocks`."""
    keys = iter(inputs.keys(seed, 4))
    args = _concrete_cu(
        s, tuple(inputs.normal(next(keys), x.shape, x.dtype) if x.dtype == BF16 else x for x in _inputs(s))
    )
    if op == "forward":
        return args
    cfg = config(s)
    do = inputs.normal(next(keys), args[0].shape, args[0].dtype)
    specs_of = residual_specs(s, impls, blocks)
    if isinstance(args[0], jax.core.Tracer):
        # traced as one program (a measured run's input builder, compiled ahead with the case's programs): every
        # forward in it; where one of them fails the run builds the inputs eagerly, through the path below
        return (*args, do, {impl: _residuals_program(impl, cfg, blocks)(*args) for impl in specs_of})
    residuals, failed = {}, {}
    # Each implementation's forward is its own program, traced here and compiled side by side: where one fails (out
    # of VMEM or HBM at a large head dim) its compile takes seconds to say so, and serially those added up to ~40 s
    # of a case on the v5e host.
    lowered = {}
    for impl in specs_of:
        try:
            lowered[impl] = _residuals_program(impl, cfg, blocks).lower(*args)
        except Exception as e:  # noqa: BLE001 - kept for the loop below, which shows why
            lowered[impl] = e.with_traceback(None)  # its frames hold q, k and v
    with concurrent.futures.ThreadPoolExecutor(max(1, len(lowered))) as pool:
        compiled = {impl: pool.submit(lambda x=x: _raise_or(x).compile()) for impl, x in lowered.items()}
        compiled = {impl: future.exception() or future.result() for impl, future in compiled.items()}
    for impl, specs in specs_of.items():
        # a failed compile's exception read, not raised: raised, it would keep this frame (q, k, v and the residuals
        # so far) in its traceback, held as long as the exception is
        failure = compiled[impl] if isinstance(compiled[impl], BaseException) else None
        if failure is None:
            try:
                residuals[impl] = compiled[impl](*args)
            except Exception as e:  # noqa: BLE001 - this implementation's forward does not run here: it shows why
                failure = e.with_traceback(None)
        if failure is not None:
            failed[impl if impl in FORWARDS_OF_OWN else BASELINE_PREFIX + impl] = (
                f"its forward (for the residuals): {reason(failure)}"
            )
            residuals[impl] = [jnp.full(x.shape, jnp.nan, x.dtype) for x in specs]  # the other programs' placeholders
    args = (*args, do, residuals)
    return PartialInputs(args, failed) if failed else args


def _raise_or(x):
    """x, or raised where it is the exception that making it raised."""
    if isinstance(x, BaseException):
        raise x
    return x


# A small window (at most tuning.SMALL_WINDOW_KEYS keys a row: gpt-oss's 128) also tries blocks of 128 rows: a 512 x
# 512 visit computes 512 x 1024 scores across two key blocks for 512 x 128 kept ones, a 128 x 128 visit pair 128 x 256
# for 128 x 128.
SMALL_WINDOW_TILES = (128, 256, 512)


def _candidates(op, s, gen):
    """The kernel's candidate tilings for op ("forward" or "backward": that direction's blocks varied) at this
    shape (tuning.candidate_blocks) for `gen`'s chip; a small window's take SMALL_WINDOW_TILES both ways."""
    q, k, v = _inputs(s)[:3]
    cfg = config(s)
    window_keys = schedule.window_keys(causal=cfg.causal, window_size=cfg.window)
    small = window_keys is not None and window_keys <= tuning.SMALL_WINDOW_KEYS
    info = chip.tpu_info_for(gen)
    # the head dims the kernels run at (the api pads head dim 64: tuning.run_head_dims)
    head_dim, v_head_dim = tuning.run_head_dims(q.shape[-1], v.shape[-1], window_keys=window_keys, info=info)
    return tuning.candidate_blocks(
        direction=op,
        tiles=(SMALL_WINDOW_TILES, SMALL_WINDOW_TILES) if small else None,
        q_rows=TOKENS,
        kv_rows=TOKENS,
        q_heads=q.shape[-2],
        kv_heads=k.shape[-2],
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        itemsize=2,
        info=info,
        window_keys=window_keys,  # the api's table choice
        **({"longest_sequence": cfg.max_seqlen} if s["layout"] == "varlen" else {"sequence_rows": (s.batch,) * 2}),
    )


# ------------------------------------------------------------------------------------------------------ targets
def _worst(rows, key):
    """The row with the least `key` (a missing value counts as the least)."""
    return min(rows, key=lambda r: -1.0 if key(r) is None else key(r))


def _target(name, rows, key, threshold, describe):
    """Met when every row's key(row) >= threshold; the detail names the worst row and how many fall short."""
    if not rows:
        return None
    worst = _worst(rows, key)
    value = key(worst)
    short = sum(1 for r in rows if key(r) is None or key(r) < threshold)
    detail = "no modeled time" if value is None else describe(value)
    if short:
        detail += f"; {short} of {len(rows)} shapes short"
    met = value is not None and value >= threshold
    return {"target": name, "met": met, "worst": {"case": worst["case"]}, "detail": detail}


def _mxu(row):
    return row["mxu_fraction"]


def _mxu_detail(threshold):
    def describe(value):
        text = f"MXU {value:.1%} of peak (modeled)"
        return text if value >= threshold else text + f", {threshold - value:.1%} points short"

    return describe


def custom_targets(rows: list[dict]) -> list[dict]:
    """The MXU targets of the forward (by head dim and mask) and the backward, and the speedup over splash."""
    long = [r for r in rows if r["batch"] >= TARGET_FROM_SEQ]
    forward = [r for r in long if r["op"] == "forward"]
    out = []
    for dim in sorted({r["shape"]["head_dim"] for r in forward}):
        threshold = MXU_TARGETS.get(dim, MXU_TARGETS[256])
        sel = [r for r in forward if r["shape"]["head_dim"] == dim and r["shape"]["mask"] == "none"]
        name = f"forward, no mask, head dim {dim}: >= {threshold:.0%} of MXU peak at seq >= {TARGET_FROM_SEQ}"
        out.append(_target(name, sel, _mxu, threshold, _mxu_detail(threshold)))
    sel = [r for r in forward if r["shape"]["mask"] == "causal"]
    name = f"forward, causal (kept scores counted): >= {CAUSAL_TARGET:.0%} of MXU peak at seq >= {TARGET_FROM_SEQ}"
    out.append(_target(name, sel, _mxu, CAUSAL_TARGET, _mxu_detail(CAUSAL_TARGET)))
    sel = [r for r in long if r["op"] == "backward"]
    name = f"backward: >= {BACKWARD_TARGET:.0%} of MXU peak at seq >= {TARGET_FROM_SEQ}"
    out.append(_target(name, sel, _mxu, BACKWARD_TARGET, _mxu_detail(BACKWARD_TARGET)))
    for op in ("forward", "backward"):
        sel = [r for r in rows if r["op"] == op and "splash" in r["speedups"]]
        name = f"{op}: >= {MIN_SPLASH_SPEEDUP}x splash attention at every shape"
        out.append(_target(name, sel, lambda r: r["speedups"]["splash"], MIN_SPLASH_SPEEDUP, lambda v: f"{v:.2f}x"))
    return [t for t in out if t is not None]


# -------------------------------------------------------------------------------------------------------- suite
def _model_args(op, s, **inputs_options):
    return _concrete_cu(s, _specs(op, s, **inputs_options))


def _op(name):
    backward = name == "backward"

    def impl(key):
        return functools.partial(_backward, FORWARDS[key], key) if backward else FORWARDS[key]

    return Op(
        name=name,
        kernel=impl("kernel"),
        default=impl("default") if backward else xla_forward,
        specs=functools.partial(_specs, name),
        model_args=functools.partial(_model_args, name),
        arrays=functools.partial(_arrays, name),
        hbm_bytes=functools.partial(_hbm_bytes, name),
        mxu_flops=functools.partial(_flops, name),
        default_name="XLA attention",
        baselines=tuple(
            Baseline(key, impl(key), functools.partial(_unsupported, key)) for key in ("jax_flash", "splash", "tokamax")
        ),
        static=lambda s: {"cfg": config(s)},
        candidates=functools.partial(_candidates, name),
        tiling_inputs=backward,
    )


SUITE = Suite(
    kernel="flash_attention",
    ops=(_op("forward"), _op("backward")),
    shapes=shapes.FLASH_ATTENTION,
    quick_shapes=shapes.FLASH_ATTENTION_QUICK,
    targets=Targets(goal=GOAL, beats_default=True, custom=custom_targets),
    batch_unit="seq",
    flops_columns=True,
)
