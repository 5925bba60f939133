"""Ragged paged attention (one step of a serving batch over a paged KV cache) against XLA's path (gather the pages,
then attention) and the TPU kernels JAX ships: ragged_paged_attention and paged_attention.

Shapes (benchmarks/shapes.py, PAGED_ATTENTION): the attention layers of Qwen3-30B-A3B (32 q / 4 kv heads x 128,
scale D^-0.5), Gemma 4's sliding layers (16 / 8 x 256, window 1024 = window_size (1023, 0), scale 1.0) and its full
layers (16 / 2 x 512, scale 1.0); q in bf16, the cache in bf16 or float8_e4m3fn (k_scale = v_scale = 0.5, static
floats). `decode`: B sequences of one new token each, every context `context` tokens (the new token included);
`mixed`: 60 decodes then 4 prefill chunks of 512 tokens (vLLM's order), every context `context`: 2108 tokens of 64
sequences in one call. The throughput counts query tokens (decode: B).

The cache is flash-attn's paged layout [pages, page, kv heads, head dim]. Each sequence owns ceil(context / page)
pages, shuffled (a random permutation, fixed seed): page tables are not contiguous. Where B x context would exceed
CACHE_POOL_BYTES (K and V together) the pool is capped and page tables draw pages from it at random: sequences may
then share pages, which changes no implementation's traffic (each reads every page its tables name) and keeps every
program within a v6e's HBM. kv_lens, page_indices, cu_q_lens and num_seqs (int32 [1], a run-time count as a server
passes it) are concrete for the performance model: our kernel's visit lists and JAX's while loops are evaluated from
them.

Roofline: the KV bytes the step must read (each sequence's context, or under the window only the keys its queries
see: min(context, q_len + window - 1), exact keys, not pages) + q read + out written, at the table HBM bandwidth.

Implementations (compiled in the same run, modeled on one TensorCore):
- kernel: tpu_kernels_jax.paged_attention.api.ragged_paged_attention (default blocks from its tuning table).
- default: XLA, the plain jnp path a framework without a paged kernel runs: gather each sequence's pages
  (`k_cache[page_indices]`; under the window only the pages it spans, from a start page computed from kv_lens), then
  masked attention with f32 scores and softmax. Sequences are grouped by query length, which XLA needs static (as the
  flash attention suite's varlen XLA path has its lengths at trace time), and chunked so that one chunk gathers at
  most XLA_GATHER_BYTES and materialises at most XLA_MAX_SCORES scores.
- jax_rpa: jax.experimental.pallas.ops.tpu.ragged_paged_attention (its tuned blocks; the scoped VMEM our kernels may
  take, at its default limit it ran out of VMEM at pages of 64) on its own cache layout, K and V
  interleaved as kv heads of one cache [pages, page, 2 Hkv, D]. The conversion from flash-attn's layout is NOT timed:
  the program receives the cache already interleaved. It reads every page of a context even under a window.
- jax_paged: jax.experimental.pallas.ops.tpu.paged_attention (decode only, no window, no fp8 scales) on its layout
  [Hkv, pages, page, D] (conversion not timed either; made only for the shapes it applies to), q pre-scaled by XLA (it
  has no scale argument), pages_per_compute_block the largest divisor of the table width <= 512 keys.
- vllm_rpa: vLLM's ragged paged attention v3 (tpu-inference's `ragged_paged_attention.v3`, the attention kernel vLLM
  serves with on TPUs) at its own default blocks, on its cache layout: K and V in one cache
  [pages, page, 2 Hkv / packing, packing, D] (packing 2 for bf16, 4 for fp8; the bytes of JAX's interleaved layout,
  `to_vllm_cache`). Its kernel returns the cache as an output aliased to the cache input (it writes the step's new
  K/V there); a cache that is a program argument without donation is copied whole before every call (the deviceless
  compile shows it: a copy of the pool ahead of the kernel), which a server, donating its cache, never pays. So its
  program allocates the cache itself (`jax.lax.empty`, no fill: the in-place program a server runs, as the KV cache
  suite does for its writes), with the case's page tables and lengths, and reads it uninitialized (the kernel's time
  does not depend on the values; `vllm_rpa_on_cache` runs the same call on a given cache, which the tests check
  against the reference). It reads every key from the cache (`update_kv_cache=False`: the case's cache already holds
  the new tokens, as for the other columns); the step's new K/V it takes as arguments are unused stand-ins.
  `distribution` marks the leading one-token sequences as decodes (vLLM's order: decodes first).
- parts (mixed batches): the same step as two calls of ours, what a mixed call is held to: the decodes alone through
  ragged_paged_attention, and the prefill chunks through flash_attention_varlen over each chunk's context laid out
  contiguously in bf16 (K and V gathered from the cache, float8 widened with its scale, outside the timed call), as a
  prefill with no paged cache reads it; one program, the two calls in turn. Goal: the mixed call within 1.1x of it.

Inputs are made on the device (benchmarks/inputs.py); page tables and lengths are drawn on the host (numpy), as
the performance model needs them concrete.

Targets, on the modeled v6e figures: decode >= 85 % of the HBM roofline at context >= 4096 and B >= 8; >= 1.2x JAX's
ragged paged attention at every shape it supports; a mixed batch at most 1.1x its parts (the parts baseline). A shape
the kernel refuses (page table and visit lists beyond its SMEM budget) stays a row with its error (JSON:
modeled_kernel.error) and counts against the targets.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax.common import chip
from tpu_kernels_jax.flash_attention import api as flash_api
from tpu_kernels_jax.paged_attention import api, tuning

from .. import inputs, shapes
from ..suite import Baseline, Op, Suite, Targets
from . import _vllm

BF16 = jnp.bfloat16
FP8 = jnp.float8_e4m3fn
FP8_SCALE = 0.5  # k_scale = v_scale for the float8 caches
# Scale of each model's attention (None: D^-0.5).
SCALE = {"qwen3-30b-a3b": None, "gemma4-sliding": 1.0, "gemma4-full": 1.0}
# K + V of one layout at most; beyond, page tables share a pool of pages. A case holds up to three layouts of it (ours,
# JAX's interleaved one, JAX's heads-major one) and vLLM's in-program cache beside them: 4 x 3 GiB within a v5e's
# 15.7 GiB with room for XLA's temporaries.
CACHE_POOL_BYTES = 3 << 30
XLA_GATHER_BYTES = 1 << 30  # gathered K + V (compute dtype) per chunk of XLA's path
XLA_MAX_SCORES = 1 << 28  # f32 scores per chunk of XLA's path (1 GiB)
JAX_SMEM_BYTES = 1 << 20  # v6e SMEM: JAX's kernels keep the page table and lengths there
JAX_PAGED_KEYS = 512  # keys per compute block of JAX's paged_attention
VLLM_RPA = "kernels.ragged_paged_attention.v3.kernel"  # tpu-inference's module (benchmarks/ops/_vllm.py)

MIN_EFFICIENCY, TARGET_FROM_CONTEXT, TARGET_FROM_BATCH = 0.85, 4096, 8
MIN_RPA_SPEEDUP = 1.2
MAX_OVER_PARTS = 1.1  # a mixed call against its decode and prefill parts run apart (the parts baseline)
GOAL = (
    f"decode >= {MIN_EFFICIENCY:.0%} of the HBM roofline at context >= {TARGET_FROM_CONTEXT} and B >= "
    f"{TARGET_FROM_BATCH}; >= {MIN_RPA_SPEEDUP}x JAX's ragged_paged_attention at every shape it supports; a mixed "
    f"batch within {MAX_OVER_PARTS}x its decode and prefill parts run apart"
)


@dataclasses.dataclass(frozen=True)
class Config:
    """The static options of one shape's call (bound to every implementation; picklable by reference)."""

    q_lens: tuple[int, ...]  # query tokens per sequence, in batch order
    contexts: tuple[int, ...]  # kv_lens (context incl. the new tokens) per sequence
    page_size: int
    pages_per_seq: int
    num_pages: int  # the pool
    q_heads: int
    kv_heads: int
    head_dim: int
    scale: float | None
    window: int  # keys a query sees (itself included), -1: unbounded
    cache_dtype: str

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    @property
    def window_size(self) -> tuple[int, int]:
        return (self.window - 1, 0) if self.window > 0 else (-1, -1)

    @property
    def fp8(self) -> bool:
        return self.cache_dtype == "float8_e4m3fn"

    @property
    def kv_scale(self) -> float | None:
        return FP8_SCALE if self.fp8 else None

    @property
    def tokens(self) -> int:
        return sum(self.q_lens)


# --------------------------------------------------------------------------------------------------- shapes, sizes
def q_lens(s) -> tuple[int, ...]:
    if s["phase"] == "decode":
        return (1,) * s.batch
    mixed = shapes.PAGED_ATTENTION_MIXED
    return (1,) * mixed["decodes"] + (mixed["chunk"],) * mixed["prefill_chunks"]


def _row_bytes(s) -> int:
    """K + V bytes of one context token (every kv head)."""
    return 2 * s["kv_heads"] * s["head_dim"] * jnp.dtype(s.dtype).itemsize


@functools.cache
def config(s) -> Config:
    lens = q_lens(s)
    page = s["page"]
    pages_per_seq = -(-s["context"] // page)
    owned = len(lens) * pages_per_seq
    pool = min(owned, max(pages_per_seq, CACHE_POOL_BYTES // (page * _row_bytes(s))))
    return Config(
        q_lens=lens,
        contexts=(s["context"],) * len(lens),
        page_size=page,
        pages_per_seq=pages_per_seq,
        num_pages=pool,
        q_heads=s["q_heads"],
        kv_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        scale=SCALE[s["model"]],
        window=s["window"],
        cache_dtype=s.dtype,
    )


def keys_read(cfg: Config) -> int:
    """Context keys the step must read, over every sequence: its context, or the keys its window spans."""
    total = 0
    for q_len, context in zip(cfg.q_lens, cfg.contexts):
        total += context if cfg.window <= 0 else min(context, q_len + cfg.window - 1)
    return total


def hbm_bytes(s) -> int:
    """The KV bytes the step must read + q read + out written (bf16)."""
    cfg = config(s)
    qo = 2 * cfg.tokens * cfg.q_heads * cfg.head_dim * 2
    return keys_read(cfg) * _row_bytes(s) + qo


def mxu_flops(s) -> int:
    """QK^T and PV over the kept scores (causal, windowed)."""
    cfg = config(s)
    kept = 0
    for q_len, context in zip(cfg.q_lens, cfg.contexts):
        pos = np.arange(context - q_len, context, dtype=np.int64)
        lo = np.maximum(pos - cfg.window + 1, 0) if cfg.window > 0 else np.zeros_like(pos)
        kept += int((pos - lo + 1).sum())
    return 2 * kept * 2 * cfg.head_dim * cfg.q_heads


def _cache_specs(cfg: Config) -> dict:
    """{layout: cache specs}: flash-attn's (kernel, XLA), JAX ragged paged attention's K/V-interleaved one, and where
    JAX's paged attention applies its heads-major one. Each program takes only its own (jit drops unused
    arguments)."""
    dt = jnp.dtype(cfg.cache_dtype)
    p, page, h, d = cfg.num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim
    flash = jax.ShapeDtypeStruct((p, page, h, d), dt)
    out = {"flash": (flash, flash), "interleaved": jax.ShapeDtypeStruct((p, page, 2 * h, d), dt)}
    if _paged_problem(cfg) is None:
        heads_major = jax.ShapeDtypeStruct((h, p, page, d), dt)
        out["heads_major"] = (heads_major, heads_major)
    if _parts_problem(cfg) is None:
        contiguous = jax.ShapeDtypeStruct((sum(cfg.contexts[_decodes(cfg) :]), h, d), BF16)
        out["contiguous"] = (contiguous, contiguous)
    return out


def _decodes(cfg: Config) -> int:
    """The leading one-token sequences (vLLM's order: decodes first)."""
    n = 0
    while n < len(cfg.q_lens) and cfg.q_lens[n] == 1:
        n += 1
    return n


def _parts_problem(cfg: Config) -> str | None:
    if _decodes(cfg) == len(cfg.q_lens):
        return "a decode batch has no prefill part"
    return None


def _contiguous(cache, page_indices, cfg: Config):
    """The prefill chunks' contexts of one cache, token after token, in bf16 ([sum of their contexts, Hkv, D])."""
    rows = []
    for seq in range(_decodes(cfg), len(cfg.q_lens)):
        pages = page_indices[seq, : -(-cfg.contexts[seq] // cfg.page_size)]
        rows.append(cache[pages].reshape(-1, cfg.kv_heads, cfg.head_dim)[: cfg.contexts[seq]])
    out = jnp.concatenate(rows).astype(BF16)
    return out * jnp.asarray(cfg.kv_scale, BF16) if cfg.fp8 else out


def _metadata(cfg: Config, seed: int = 0):
    """Concrete kv_lens, page_indices (shuffled pages), cu_q_lens and num_seqs (int32 [1])."""
    rng = np.random.default_rng(seed)
    n = len(cfg.q_lens)
    owned = n * cfg.pages_per_seq
    if owned <= cfg.num_pages:
        pages = rng.permutation(cfg.num_pages)[:owned].reshape(n, cfg.pages_per_seq)
    else:
        pages = rng.integers(0, cfg.num_pages, (n, cfg.pages_per_seq))
    cu = np.concatenate([[0], np.cumsum(cfg.q_lens)])
    return (
        jnp.asarray(np.asarray(cfg.contexts, np.int32)),
        jnp.asarray(pages.astype(np.int32)),
        jnp.asarray(cu.astype(np.int32)),
        jnp.asarray(np.asarray([n], np.int32)),
    )


def _q_spec(cfg: Config):
    return jax.ShapeDtypeStruct((cfg.tokens, cfg.q_heads, cfg.head_dim), BF16)


def specs(s):
    cfg = config(s)
    n = len(cfg.q_lens)
    i32 = jnp.int32
    return (
        _q_spec(cfg),
        _cache_specs(cfg),
        jax.ShapeDtypeStruct((n,), i32),
        jax.ShapeDtypeStruct((n, cfg.pages_per_seq), i32),
        jax.ShapeDtypeStruct((n + 1,), i32),
        jax.ShapeDtypeStruct((1,), i32),
    )


def model_args(s):
    """specs with the metadata concrete (the visit lists, JAX's loops and XLA's gathers follow them)."""
    q, caches, *_ = specs(s)
    return (q, caches, *_metadata(config(s)))


def arrays(s, seed):
    """Every argument concrete (timing on the device that is present): random q and flash-layout caches made on the
    device, the other layouts converted from them there (outside the timed call); the metadata from the host."""
    cfg = config(s)
    key_q, key_k, key_v = inputs.keys(seed, 3)
    q = inputs.normal(key_q, _q_spec(cfg).shape, BF16)
    specs = _cache_specs(cfg)
    flash = specs["flash"][0]
    k, v = (inputs.normal(key, flash.shape, flash.dtype) for key in (key_k, key_v))
    caches = {"flash": (k, v), "interleaved": _interleave(k, v)}
    if "heads_major" in specs:
        caches["heads_major"] = _heads_major(k), _heads_major(v)
    metadata = _metadata(cfg, seed)
    if "contiguous" in specs:
        caches["contiguous"] = tuple(_contiguous(x, metadata[1], cfg) for x in (k, v))
    return (q, caches, *metadata)


def to_interleaved(k, v):
    """flash-attn's two caches as JAX ragged paged attention's one [pages, page, 2 Hkv, D]: K at even kv heads."""
    p, page, h, d = k.shape
    return jnp.stack([k, v], axis=3).reshape(p, page, 2 * h, d)


def to_vllm_cache(k, v):
    """flash-attn's two caches as vLLM's RPA v3 cache [pages, page, 2 Hkv / packing, packing, D]: each kv head's K then
    V, in groups of the dtype's packing (32 bits: 2 bf16, 4 fp8), the same bytes as `to_interleaved`'s."""
    p, page, h, d = k.shape
    packing = _vllm_packing(k.dtype)
    return to_interleaved(k, v).reshape(p, page, 2 * h // packing, packing, d)


_interleave = jax.jit(to_interleaved)
_heads_major = jax.jit(lambda x: x.transpose(2, 0, 1, 3))


# ------------------------------------------------------------------------------------------------ implementations
def kernel_attention(q, caches, kv_lens, page_indices, cu_q_lens, num_seqs, *, cfg: Config, blocks=None):
    k_cache, v_cache = caches["flash"]
    return api.ragged_paged_attention(
        q,
        k_cache,
        v_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        softmax_scale=cfg.softmax_scale,
        causal=True,
        window_size=cfg.window_size,
        k_scale=cfg.kv_scale,
        v_scale=cfg.kv_scale,
        blocks=blocks,
    )


def parts_attention(q, caches, kv_lens, page_indices, cu_q_lens, num_seqs, *, cfg: Config):
    """The mixed step as its parts: the decodes through ragged_paged_attention alone, the prefill chunks through
    flash_attention_varlen over their contexts laid out contiguously (caches["contiguous"]); outputs in token order."""
    n = _decodes(cfg)
    k_cache, v_cache = caches["flash"]
    decodes = api.ragged_paged_attention(
        q[:n],
        k_cache,
        v_cache,
        kv_lens[:n],
        page_indices[:n],
        cu_q_lens[: n + 1],
        jnp.asarray([n], jnp.int32),
        softmax_scale=cfg.softmax_scale,
        causal=True,
        window_size=cfg.window_size,
        k_scale=cfg.kv_scale,
        v_scale=cfg.kv_scale,
    )
    lens_q, lens_k = cfg.q_lens[n:], cfg.contexts[n:]
    cu_q, cu_k = (jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32) for lens in (lens_q, lens_k))
    k, v = caches["contiguous"]
    prefill = flash_api.flash_attention_varlen(
        q[n:],
        k,
        v,
        cu_q,
        cu_k,
        max(lens_q),
        max(lens_k),
        softmax_scale=cfg.softmax_scale,
        causal=True,
        window_size=cfg.window_size,
    )
    return jnp.concatenate([decodes, prefill])


def _parts_unsupported(s) -> str | None:
    return _parts_problem(config(s))


def _xla_pages(cfg: Config, q_len: int) -> int:
    """Pages XLA's path gathers per sequence for queries of q_len tokens: all, or those the window spans."""
    if cfg.window <= 0:
        return cfg.pages_per_seq
    return min(cfg.pages_per_seq, -(-(q_len + cfg.window - 1) // cfg.page_size) + 1)


def _xla_group(q, k_cache, v_cache, kv_lens, page_indices, cfg: Config):
    """Attention of b sequences with q_len queries each: q [b, q_len, Hq, D] -> [b, q_len, Hq, D]."""
    b, q_len, hq, d = q.shape
    hkv, page = cfg.kv_heads, cfg.page_size
    n = _xla_pages(cfg, q_len)
    if n < cfg.pages_per_seq:  # the window's pages, from the first one its first query sees
        first = (kv_lens - q_len - (cfg.window - 1)) // page
        start = jnp.clip(first, 0, cfg.pages_per_seq - n)
    else:
        start = jnp.zeros_like(kv_lens)
    table = jnp.take_along_axis(page_indices, start[:, None] + jnp.arange(n, dtype=jnp.int32)[None], axis=1)

    def gather(cache):
        x = cache[table].reshape(b, n * page, hkv, d)
        if cfg.fp8:
            x = (x.astype(jnp.float32) * cfg.kv_scale).astype(BF16)
        return x

    k, v = gather(k_cache), gather(v_cache)
    qg = q.reshape(b, q_len, hkv, hq // hkv, d)
    scores = jnp.einsum("brhgd,bshd->bhgrs", qg, k, preferred_element_type=jnp.float32) * cfg.softmax_scale
    key = start[:, None, None] * page + jnp.arange(n * page, dtype=jnp.int32)[None, None, :]  # [b, 1, S]
    pos = (kv_lens - q_len)[:, None, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :, None]  # [b, r, 1]
    keep = (key <= pos) & (key < kv_lens[:, None, None])
    if cfg.window > 0:
        keep &= key > pos - cfg.window
    probs = jax.nn.softmax(jnp.where(keep[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgrs,bshd->brhgd", probs.astype(BF16), v, preferred_element_type=jnp.float32)
    return out.reshape(b, q_len, hq, d).astype(q.dtype)


def _xla_chunks(cfg: Config):
    """[(first sequence, end, q_len)]: runs of equal query length, cut to the gather and score budgets."""
    out, s = [], 0
    n = len(cfg.q_lens)
    while s < n:
        q_len = cfg.q_lens[s]
        end = s
        while end < n and cfg.q_lens[end] == q_len:
            end += 1
        keys = _xla_pages(cfg, q_len) * cfg.page_size
        gathered = keys * cfg.kv_heads * cfg.head_dim * 2 * 2  # K and V of one sequence in bf16
        step = max(1, min(XLA_GATHER_BYTES // gathered, XLA_MAX_SCORES // (cfg.q_heads * q_len * keys)))
        for a in range(s, end, step):
            out.append((a, min(end, a + step), q_len))
        s = end
    return out


def reference_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, *, cfg: Config):
    """The kernels' own f32 reference at a case's options (scale, window, fp8 scales): what the tests hold every
    implementation of the suite to."""
    from tpu_kernels_jax.paged_attention.reference import ragged_paged_attention_reference

    return ragged_paged_attention_reference(
        q,
        k_cache,
        v_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        softmax_scale=cfg.softmax_scale,
        window_size=cfg.window_size,
        k_scale=cfg.kv_scale,
        v_scale=cfg.kv_scale,
    )


def xla_attention(q, caches, kv_lens, page_indices, cu_q_lens, num_seqs, *, cfg: Config):
    """Gather, then attention, per static chunk of sequences (query offsets from cfg.q_lens, known at trace time)."""
    k_cache, v_cache = caches["flash"]
    starts = np.concatenate([[0], np.cumsum(cfg.q_lens)])
    outs = []
    for a, b, q_len in _xla_chunks(cfg):
        rows = q[starts[a] : starts[b]].reshape(b - a, q_len, cfg.q_heads, cfg.head_dim)
        out = _xla_group(rows, k_cache, v_cache, kv_lens[a:b], page_indices[a:b], cfg)
        outs.append(out.reshape((b - a) * q_len, cfg.q_heads, cfg.head_dim))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)


def _device_kind() -> str:
    """The kind of the device the program is traced for: the model's deviceless TPU (jax.default_device), else the
    first device."""
    dev = jax.config.jax_default_device
    return (dev if dev is not None and not isinstance(dev, str) else jax.devices()[0]).device_kind


# Keys x head dim of one block of JAX's ragged paged attention where its tuned table has no entry. Its default block
# (128 pages, capped at the sequence's) unrolls the whole block's cache unpacking: at Gemma 4's full layers (head dim
# 512, float8 cache, 64 pages of 64) one compile took ~2 minutes and 5.8 GB of host memory (deviceless for v5e; 22 s
# at 32 pages, 6 s at 16), and stalled a benchmark run on the chip. Qwen3's (head dim 128) and Gemma 4's sliding
# layers (256) keep the default's 64 pages.
RPA_DEFAULT_BLOCK_KEY_ELEMENTS = 1 << 20


def _rpa_blocks(q, kv_pages, page_indices) -> tuple[int, int]:
    """(num_kv_pages_per_block, num_queries_per_block) from JAX's own tuned table for the traced-for chip (its lookup
    asks jax.devices(), which is the CPU under the model's deviceless trace); its defaults where the table has none,
    the pages capped to RPA_DEFAULT_BLOCK_KEY_ELEMENTS keys x head dim."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa_kernel
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned

    q_heads_blk, kv_heads_blk = rpa_kernel.get_min_heads_per_blk(q.shape[1], kv_pages.shape[2], q.dtype, kv_pages.dtype)
    pages_per_seq = page_indices.shape[1]
    key = tuned.simplify_key(
        (
            q.dtype,
            kv_pages.dtype,
            q_heads_blk,
            kv_heads_blk // 2,
            q.shape[2],
            kv_pages.shape[1],
            q.shape[0],
            pages_per_seq,
        )
    )
    name = " ".join(_device_kind().split()[:2])
    tuned_blocks = tuned.TUNED_BLOCK_SIZES.get(name, {}).get(key)
    if tuned_blocks is None:
        page_size, head_dim = kv_pages.shape[1], q.shape[2]
        tuned_blocks = (min(128, max(1, RPA_DEFAULT_BLOCK_KEY_ELEMENTS // (page_size * head_dim))), 32)
    bkv, bq = tuned_blocks
    return min(pages_per_seq, bkv), min(q.shape[0], bq)


def _rpa_options(cfg: Config) -> dict:
    """The scale, window and fp8 scales as JAX's and vLLM's ragged paged attention both take them."""
    window = cfg.window if cfg.window > 0 else None
    return dict(sm_scale=cfg.softmax_scale, sliding_window=window, k_scale=cfg.kv_scale, v_scale=cfg.kv_scale)


def _scoped_vmem_ceiling() -> int:
    """The most scoped VMEM our kernels ask for on the traced-for chip (chip.scoped_vmem_ceiling), which JAX's ragged
    paged attention is given too: at its own default scoped limit (16 MiB) it ran out of VMEM at Qwen3's pages of 64
    on the v5e (the quick shapes, its tuned or default blocks: 64 or 128 pages of 64 keys a block); at 64 MiB all
    compile (deviceless, v5e)."""
    return chip.scoped_vmem_ceiling(chip.current_tpu_info())


def jax_rpa_attention(q, caches, kv_lens, page_indices, cu_q_lens, num_seqs, *, cfg: Config):
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    pages_per_block, queries_per_block = _rpa_blocks(q, caches["interleaved"], page_indices)
    return rpa.ragged_paged_attention(
        q,
        caches["interleaved"],
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        **_rpa_options(cfg),
        num_kv_pages_per_block=pages_per_block,
        num_queries_per_block=queries_per_block,
        vmem_limit_bytes=_scoped_vmem_ceiling(),
    )


def _jax_paged_block(cfg: Config) -> int:
    target = max(1, JAX_PAGED_KEYS // cfg.page_size)
    return max(p for p in range(1, min(target, cfg.pages_per_seq) + 1) if cfg.pages_per_seq % p == 0)


def jax_paged_attention(q, caches, kv_lens, page_indices, cu_q_lens, num_seqs, *, cfg: Config):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    k_pages, v_pages = caches["heads_major"]
    q = (q.astype(jnp.float32) * cfg.softmax_scale).astype(q.dtype)
    return paged_attention(q, k_pages, v_pages, kv_lens, page_indices, pages_per_compute_block=_jax_paged_block(cfg))


def _vllm_packing(dtype) -> int:
    return 4 // jnp.dtype(dtype).itemsize


def vllm_cache_spec(cfg: Config) -> jax.ShapeDtypeStruct:
    """vLLM's RPA v3 cache of this config's pool (to_vllm_cache's shape)."""
    packing = _vllm_packing(cfg.cache_dtype)
    shape = (cfg.num_pages, cfg.page_size, 2 * cfg.kv_heads // packing, packing, cfg.head_dim)
    return jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.cache_dtype))


def vllm_rpa_on_cache(q, kv_cache, kv_lens, page_indices, cu_q_lens, *, cfg: Config):
    """vLLM's RPA v3 on a cache in its layout (to_vllm_cache), reading every key from the cache; default blocks,
    the VMEM limit vLLM passes (the core's whole VMEM)."""
    rpa = _vllm.kernel_module(VLLM_RPA)
    n = len(cfg.q_lens)
    decodes = next((i for i, q_len in enumerate(cfg.q_lens) if q_len != 1), n)
    distribution = jnp.asarray([decodes, decodes, n], jnp.int32)
    new_kv = jax.lax.empty((q.shape[0], cfg.kv_heads, cfg.head_dim), kv_cache.dtype)  # unused (update_kv_cache off)
    out, _ = rpa.ragged_paged_attention(
        q,
        new_kv,
        new_kv,
        kv_cache,
        kv_lens,
        page_indices.reshape(-1),
        cu_q_lens,
        distribution,
        **_rpa_options(cfg),
        update_kv_cache=False,
        vmem_limit_bytes=chip.current_tpu_info().vmem_capacity_bytes,
    )
    return out


def vllm_rpa_attention(q, caches, kv_lens, page_indices, cu_q_lens, num_seqs, *, cfg: Config):
    """vllm_rpa_on_cache on a cache the program allocates and does not fill (see the module docstring)."""
    spec = vllm_cache_spec(cfg)
    return vllm_rpa_on_cache(q, jax.lax.empty(spec.shape, spec.dtype), kv_lens, page_indices, cu_q_lens, cfg=cfg)


def _smem_table_bytes(cfg: Config) -> int:
    n = len(cfg.q_lens)
    return 4 * (n * cfg.pages_per_seq + 2 * n + 2)


def _rpa_unsupported(s) -> str | None:
    cfg = config(s)
    if _smem_table_bytes(cfg) > JAX_SMEM_BYTES:
        return "JAX's kernels keep the whole page table in SMEM (1 MiB on v6e): too large at this B x pages"
    return None


def _paged_problem(cfg: Config) -> str | None:
    if any(q_len != 1 for q_len in cfg.q_lens):
        return "JAX's paged_attention is decode only (one query token per sequence)"
    if cfg.window > 0:
        return "JAX's paged_attention has no sliding window"
    if cfg.fp8:
        return "JAX's paged_attention reads bf16 or int8 (QuantizedTensor) pages, not fp8 with a tensor scale"
    if _smem_table_bytes(cfg) > JAX_SMEM_BYTES:
        return "JAX's kernels keep the whole page table in SMEM (1 MiB on v6e): too large at this B x pages"
    return None


def _paged_unsupported(s) -> str | None:
    return _paged_problem(config(s))


def _vllm_unsupported(s) -> str | None:
    why = _vllm.missing()
    if why:
        return why
    try:
        rpa = _vllm.kernel_module(VLLM_RPA)
    except Exception as e:  # noqa: BLE001 - an import that fails here must not stop the other columns
        return f"tpu-inference's RPA v3 does not import: {type(e).__name__}: {e}"
    cfg = config(s)
    smem = rpa.get_smem_estimate_bytes(len(cfg.q_lens), cfg.pages_per_seq)
    if smem > JAX_SMEM_BYTES:
        return f"vLLM's RPA v3 keeps the page table in SMEM ({smem // 1024} KiB here, over the 1 MiB of v6e)"
    return None


# ------------------------------------------------------------------------------------------------------ targets
def _kernel_bound(row) -> str:
    """What the model says bounds the kernel: its compute and DMA time (modeled) and which dominates."""
    kernels = row["modeled_kernel"].get("kernels") or []
    if not kernels:
        return ""
    k = max(kernels, key=lambda k: k["us"])
    return (
        f"; kernel {k['us']:.1f} µs: {k['bound']}-bound, compute {k['compute_us']:.1f} µs vs DMA {k['hbm_us']:.1f} µs, "
        f"{len(k['grid']) and k['grid'][0]} visits"
    )


def _target(name, rows, key, threshold, describe, explain=lambda r: ""):
    if not rows:
        return None
    worst = min(rows, key=lambda r: -1.0 if key(r) is None else key(r))
    value = key(worst)
    short = sum(1 for r in rows if key(r) is None or key(r) < threshold)
    refused = sum(1 for r in rows if "error" in r["modeled_kernel"])
    detail = f"refused by the kernel: {worst['modeled_kernel']['error'][:160]}" if value is None else describe(value)
    if short:
        detail += f"; {short} of {len(rows)} shapes short"
    if refused:
        detail += f" ({refused} refused by the kernel)"
    if value is not None and value < threshold:
        detail += explain(worst)
    return {"target": name, "met": short == 0, "worst": {"case": worst["case"]}, "detail": detail}


def _over_baseline(rows, baseline: str, name: str, threshold: float, describe):
    """The target of our speedup over `baseline` at every shape where it ran."""
    sel = [r for r in rows if not {"na", "error"} & set(r["modeled_baselines"].get(baseline, {"na": ""}))]
    return _target(name, sel, lambda r: r["speedups"].get(baseline), threshold, describe, _kernel_bound)


def custom_targets(rows: list[dict]) -> list[dict]:
    out = []
    sel = [
        r
        for r in rows
        if r["shape"]["phase"] == "decode"
        and r["shape"]["context"] >= TARGET_FROM_CONTEXT
        and r["batch"] >= TARGET_FROM_BATCH
    ]
    name = (
        f"decode: >= {MIN_EFFICIENCY:.0%} of the HBM roofline at context >= {TARGET_FROM_CONTEXT} and "
        f"B >= {TARGET_FROM_BATCH}"
    )
    out.append(
        _target(name, sel, lambda r: r["efficiency"], MIN_EFFICIENCY, lambda v: f"efficiency {v:.1%}", _kernel_bound)
    )
    name = f">= {MIN_RPA_SPEEDUP}x JAX's ragged_paged_attention at every shape it supports"
    out.append(_over_baseline(rows, "jax_rpa", name, MIN_RPA_SPEEDUP, lambda v: f"{v:.2f}x"))
    name = f"mixed: at most {MAX_OVER_PARTS}x its decode and prefill parts run apart (the parts column)"
    out.append(_over_baseline(rows, "parts", name, 1 / MAX_OVER_PARTS, lambda v: f"{1 / v:.2f}x the parts"))
    return [t for t in out if t is not None]


def _candidates(s, gen):
    """The kernel's candidate blocks at this shape for `gen`'s chip (tuning.candidate_blocks, the table's first), with
    the arguments the api resolves its blocks from (kernel_attention: causal, the config's window)."""
    cfg = config(s)
    left, _ = cfg.window_size
    return tuning.candidate_blocks(
        tokens=cfg.tokens,
        num_seqs=len(cfg.q_lens),
        group=cfg.q_heads // cfg.kv_heads,
        page_size=cfg.page_size,
        pages_per_seq=cfg.pages_per_seq,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        v_head_dim=cfg.head_dim,
        q_dtype=BF16,
        cache_dtype=jnp.dtype(cfg.cache_dtype),
        window_size=(left, 0),
        info=chip.tpu_info_for(gen),
    )


# -------------------------------------------------------------------------------------------------------- suite
SUITE = Suite(
    kernel="paged_attention",
    ops=(
        Op(
            name="ragged_paged_attention",
            kernel=kernel_attention,
            default=xla_attention,
            specs=specs,
            model_args=model_args,
            arrays=arrays,
            hbm_bytes=hbm_bytes,
            mxu_flops=mxu_flops,
            default_name="XLA gather + attention",
            baselines=(
                Baseline("jax_rpa", jax_rpa_attention, _rpa_unsupported),
                Baseline("jax_paged", jax_paged_attention, _paged_unsupported),
                Baseline("vllm_rpa", vllm_rpa_attention, _vllm_unsupported),
                Baseline("parts", parts_attention, _parts_unsupported),
            ),
            static=lambda s: {"cfg": config(s)},
            candidates=_candidates,
        ),
    ),
    shapes=shapes.PAGED_ATTENTION,
    quick_shapes=shapes.PAGED_ATTENTION_QUICK,
    targets=Targets(goal=GOAL, custom=custom_targets),
    batch_unit="tokens",
)
