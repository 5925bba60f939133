"""Benchmark shapes: declared once per kernel, here, and imported by everything that needs them.

The benchmark suites (`benchmarks/ops/<kernel>.py`) time and model these shapes; the deviceless-compile tests
(`tests/test_<kernel>.py`, ladder rung 3) prove that every one of them lowers, lays out and fits VMEM on v5e, v6e and
v7x. A shape added here is therefore compiled by `make test` and benchmarked by `make bench`.

A `Shape` is one benchmark point: `batch` is the quantity the throughput chart puts on its x axis (tokens for
RMSNorm and rotary, tokens per step for ragged dot), `params` are the other problem sizes, and `series` names the
line of the chart the point belongs to (the params that are not the batch). To add a kernel, declare its shapes
below with `sweep(...)` and list them in `SHAPES`.

This module imports nothing but the standard library, so tests and subprocesses can import it cheaply.
"""

from __future__ import annotations

import dataclasses
import itertools


@dataclasses.dataclass(frozen=True)
class Shape:
    batch_name: str  # "tokens", "batch", ...
    batch: int
    params: tuple[tuple[str, int | str], ...] = ()
    dtype: str = "bfloat16"

    def __getitem__(self, name: str):
        if name == self.batch_name:
            return self.batch
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(name)

    @property
    def series(self) -> str:
        """The chart line: every param but the batch, e.g. "hidden=2048"."""
        return " ".join(f"{k}={v}" for k, v in self.params) or self.dtype

    @property
    def id(self) -> str:
        """Stable, readable id, e.g. "tokens=4096 hidden=2048 bfloat16" (pytest ids, JSON, table)."""
        return f"{self.batch_name}={self.batch} {self.series} {self.dtype}".replace("  ", " ")

    def as_dict(self) -> dict:
        return {self.batch_name: self.batch, **dict(self.params), "dtype": self.dtype}


def sweep(batch_name: str, batches, dtype: str = "bfloat16", **param_values) -> tuple[Shape, ...]:
    """The cross product of `batches` with every param's values (each a value or an iterable of values), ordered
    by series then batch."""
    names = list(param_values)
    values = [v if isinstance(v, (list, tuple)) else (v,) for v in param_values.values()]
    return tuple(
        Shape(batch_name, int(b), tuple(zip(names, combo)), dtype)
        for combo in itertools.product(*values)
        for b in batches
    )


# ---------------------------------------------------------------------------------------------------------- RMSNorm
# Decode (1-64 tokens) to long prefill (32768 tokens), at the hidden sizes of Qwen3-30B-A3B (2048) and 8B-class
# models (4096). bf16, the dtype models run in.
RMS_NORM_TOKENS = (1, 8, 64, 512, 4096, 32768)
RMS_NORM_HIDDENS = (2048, 4096)
RMS_NORM = sweep("tokens", RMS_NORM_TOKENS, hidden=RMS_NORM_HIDDENS)

# ------------------------------------------------------------------------------------------------ ragged dot, MoE
# MoE expert layers: top-8 of 128 experts, (hidden, moe intermediate size) per model, the expert activation.
# Tokens are routed at random (uniform choice of top_k distinct experts per token, fixed seed; see
# benchmarks/ops/_moe.py), not balanced by construction.
MOE_MODELS = {
    "qwen3-30b-a3b": {"hidden": 2048, "intermediate": 768, "activation": "silu"},
    "gemma4-26b-a4b": {"hidden": 2816, "intermediate": 704, "activation": "gelu_tanh"},
}
MOE_EXPERTS, MOE_TOP_K = 128, 8
RAGGED_DOT_DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode batch B: B * top_k rows
RAGGED_DOT_PREFILL_ROWS = (4096, 32768, 131072)  # prefill: M rows of the grouped matmul (M / top_k tokens)
# `python -m benchmarks` without --full models this subset (keeps `make bench` short); --full models everything.
RAGGED_DOT_QUICK_TOKENS = (1, 8, 64, 256)
RAGGED_DOT_QUICK_ROWS = (4096,)


def _moe_sweep(decode_tokens, prefill_rows):
    out = []
    for model, dims in MOE_MODELS.items():
        common = dict(model=model, experts=MOE_EXPERTS, top_k=MOE_TOP_K, **dims)
        out += sweep("tokens", decode_tokens, phase="decode", **common)
        out += sweep("rows", prefill_rows, phase="prefill", **common)
    return tuple(out)


# Each grouped matmul of the MoE (gate/up with the fused activation, down): decode batches and prefill rows.
RAGGED_DOT = _moe_sweep(RAGGED_DOT_DECODE_TOKENS, RAGGED_DOT_PREFILL_ROWS)
RAGGED_DOT_QUICK = _moe_sweep(RAGGED_DOT_QUICK_TOKENS, RAGGED_DOT_QUICK_ROWS)
# The whole experts_forward: decode batches, and (--full only) prefill of 512 and 4096 tokens (4096 and 32768 rows).
MOE_PREFILL_ROWS = (4096, 32768)
# Quantized expert weights (the Shape's dtype is the weights'; activations bf16, per-output-channel f32 scales) at the
# decode batches the decode target covers (B <= 64).
MOE_QUANTIZED_DTYPES = ("int8", "float8_e4m3fn")
MOE_QUANTIZED_TOKENS = tuple(b for b in RAGGED_DOT_DECODE_TOKENS if b <= 64)
MOE_QUANTIZED_QUICK_TOKENS = tuple(b for b in RAGGED_DOT_QUICK_TOKENS if b <= 64)


def _moe_quantized_sweep(decode_tokens):
    return tuple(
        shape
        for dtype in MOE_QUANTIZED_DTYPES
        for model, dims in MOE_MODELS.items()
        for shape in sweep(
            "tokens", decode_tokens, dtype, phase="decode", model=model, experts=MOE_EXPERTS, top_k=MOE_TOP_K, **dims
        )
    )


MOE = _moe_sweep(RAGGED_DOT_DECODE_TOKENS, MOE_PREFILL_ROWS) + _moe_quantized_sweep(MOE_QUANTIZED_TOKENS)
MOE_QUICK = _moe_sweep(RAGGED_DOT_QUICK_TOKENS, ()) + _moe_quantized_sweep(MOE_QUANTIZED_QUICK_TOKENS)
# gpt-oss-20b's experts (32 experts, top-4, hidden = intermediate = 2880, gate/up interleaved, its clamped SwiGLU;
# the benchmark leaves out its biases), in bf16 and in its checkpoint's MXFP4 (dtype "mxfp4": e2m1 codes packed two a
# byte with an e8m0 scale per 32), at decode batches. Modeled by the MoE suite beside MOE (not compiled by the
# deviceless tests: tests/test_moe.py compiles the MXFP4 experts at this shape itself).
MOE_GPT_OSS_DIMS = {"hidden": 2880, "intermediate": 2880, "activation": "clamped_swiglu", "gate_layout": "interleaved"}
MOE_GPT_OSS_TOKENS = (1, 8, 64)
MOE_GPT_OSS = tuple(
    shape
    for dtype in ("bfloat16", "mxfp4")
    for shape in sweep(
        "tokens",
        MOE_GPT_OSS_TOKENS,
        dtype,
        phase="decode",
        model="gpt-oss-20b",
        experts=32,
        top_k=4,
        **MOE_GPT_OSS_DIMS,
    )
)

# ---------------------------------------------------------------------------------------------------------- rotary
# RoPE and fused per-head RMSNorm + RoPE of q and k, at the attention shapes of Qwen3-30B-A3B and Gemma 4
# 26B-A4B (sliding and full-attention layers). Gemma 4's full layers rotate a quarter of head_dim through
# transformers' "proportional" tables: full-width cos/sin whose trailing frequencies are zero, so rotary_dim is
# head_dim. Decode: `tokens` sequences, one position each; prefill: one sequence of `tokens` positions.
ROTARY_MODELS = {
    "qwen3-30b-a3b": {"q_heads": 32, "kv_heads": 4, "head_dim": 128, "rotary_dim": 128},
    "gemma4-sliding": {"q_heads": 16, "kv_heads": 8, "head_dim": 256, "rotary_dim": 256},
    "gemma4-full": {"q_heads": 16, "kv_heads": 2, "head_dim": 512, "rotary_dim": 512},
}
ROTARY_DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ROTARY_PREFILL_SEQS = (2048, 32768)
ROTARY = tuple(
    shape
    for model, dims in ROTARY_MODELS.items()
    for phase, tokens in (("decode", ROTARY_DECODE_BATCHES), ("prefill", ROTARY_PREFILL_SEQS))
    for shape in sweep("tokens", tokens, model=model, phase=phase, **dims)
)

# Every kernel's shapes, by the kernel name used in `python -m benchmarks --kernel NAME`.
# ------------------------------------------------------------------------------------------------- flash attention
# Prefill / training attention at the layers of Qwen3-30B-A3B, Gemma 4 26B-A4B's sliding layers (window 1024:
# transformers passes window_size = (1023, 0)) and its full layers (head dim 512, K = V, scale 1.0), and gpt-oss-20b's
# sliding (window 128) and full layers (head dim 64, 64 query heads over 8 kv heads, sinks). `seq` is the
# sequence length; the batch fills about 32k tokens (32768 // seq sequences). layout "dense" is flash_attn_func's
# [B, S, H, D]; "varlen" packs the same tokens as sequences of mixed lengths (fixed seed, mean `seq`; see
# benchmarks/ops/flash_attention.py), flash_attn_varlen_func's path.
FLASH_ATTENTION_MODELS = {
    "qwen3-30b-a3b": {"q_heads": 32, "kv_heads": 4, "head_dim": 128, "window": -1},
    "gemma4-sliding": {"q_heads": 16, "kv_heads": 8, "head_dim": 256, "window": 1024},
    "gemma4-full": {"q_heads": 16, "kv_heads": 2, "head_dim": 512, "window": -1},
    "gpt-oss-sliding": {"q_heads": 64, "kv_heads": 8, "head_dim": 64, "window": 128},
    "gpt-oss-full": {"q_heads": 64, "kv_heads": 8, "head_dim": 64, "window": -1},
}
# Models whose attention has sinks (a learned logit per query head in every row's softmax): gpt-oss's layers, a
# decoder's, causal only.
FLASH_ATTENTION_SINKS = ("gpt-oss-sliding", "gpt-oss-full")
FLASH_ATTENTION_TOKENS = 32768
FLASH_ATTENTION_SEQS = (1024, 4096, 8192, 32768)
FLASH_ATTENTION_QUICK_SEQS = (4096,)


def _attention_sweep(seqs, varlen_seqs):
    out = []
    for model, dims in FLASH_ATTENTION_MODELS.items():
        masks = ("causal",) if dims["window"] > 0 or model in FLASH_ATTENTION_SINKS else ("causal", "none")
        for mask in masks:
            out += sweep("seq", seqs, model=model, mask=mask, layout="dense", **dims)
            out += sweep("seq", varlen_seqs, model=model, mask=mask, layout="varlen", **dims)
    return tuple(out)


FLASH_ATTENTION = _attention_sweep(FLASH_ATTENTION_SEQS, (1024, 4096))
FLASH_ATTENTION_QUICK = _attention_sweep(FLASH_ATTENTION_QUICK_SEQS, ())

# ------------------------------------------------------------------------------------------------- paged attention
# One serving step over a paged KV cache (benchmarks/ops/paged_attention.py): the attention layers of Qwen3-30B-A3B,
# Gemma 4's sliding (window 1024) and full layers; page sizes 16, 32, 64, 128, 256; bf16 and fp8 (e4m3) caches (the
# Shape's dtype is the cache's; q is bf16). decode: `batch` sequences of one token at `context`; mixed: 60 decodes and 4
# prefill chunks of 512 (`tokens` = 2108 query tokens of 64 sequences), every context `context`.
PAGED_ATTENTION_MODELS = {
    "qwen3-30b-a3b": {"q_heads": 32, "kv_heads": 4, "head_dim": 128, "window": -1},
    "gemma4-sliding": {"q_heads": 16, "kv_heads": 8, "head_dim": 256, "window": 1024},
    "gemma4-full": {"q_heads": 16, "kv_heads": 2, "head_dim": 512, "window": -1},
}
PAGED_ATTENTION_BATCHES = (1, 8, 32, 64, 128, 256)
PAGED_ATTENTION_CONTEXTS = (1024, 4096, 32768)
PAGED_ATTENTION_PAGES = (16, 32, 64, 128, 256)
PAGED_ATTENTION_DTYPES = ("bfloat16", "float8_e4m3fn")
PAGED_ATTENTION_MIXED = {"decodes": 60, "prefill_chunks": 4, "chunk": 512}
PAGED_ATTENTION_MIXED_TOKENS = PAGED_ATTENTION_MIXED["decodes"] + 4 * 512
# `make bench` (no --full): context 4096 at page 64, B 8 / 64 / 256, bf16 and fp8, and the mixed batch in bf16.
PAGED_ATTENTION_QUICK_BATCHES = (8, 64, 256)


def _paged_sweep(batches, contexts, pages, dtypes, mixed_dtypes):
    out = []
    for model, dims in PAGED_ATTENTION_MODELS.items():
        for dtype in dtypes:
            out += sweep("batch", batches, dtype, model=model, phase="decode", context=contexts, page=pages, **dims)
        for dtype in mixed_dtypes:
            out += sweep(
                "tokens",
                (PAGED_ATTENTION_MIXED_TOKENS,),
                dtype,
                model=model,
                phase="mixed",
                context=contexts,
                page=pages,
                **dims,
            )
    return tuple(out)


# `--full`: every batch at every page size at context 4096 in bf16, at pages of 16, 64 and 256 in fp8; every context at
# pages of 64; the mixed batch at pages of 16, 64 and 256 (fp8 at 64). 192 cases, not the 630 of the whole product: at
# the chip's 5.5 s of host time a paged attention case (benchmarks/__main__.py HOST_S_PER_CASE) they take ~18 minutes,
# which with the other kernels' full suites keeps `--full` within its 40 (the product would need ~58 alone).
PAGED_ATTENTION_PAGES_FP8 = (16, 64, 256)
PAGED_ATTENTION = (
    _paged_sweep(PAGED_ATTENTION_BATCHES, (4096,), PAGED_ATTENTION_PAGES, ("bfloat16",), ())
    + _paged_sweep(PAGED_ATTENTION_BATCHES, (4096,), PAGED_ATTENTION_PAGES_FP8, ("float8_e4m3fn",), ())
    + _paged_sweep(PAGED_ATTENTION_BATCHES, (1024, 32768), (64,), ("bfloat16",), ())
    + _paged_sweep((), (4096,), PAGED_ATTENTION_PAGES_FP8, (), ("bfloat16",))
    + _paged_sweep((), (4096,), (64,), (), ("float8_e4m3fn",))
)
PAGED_ATTENTION_QUICK = _paged_sweep(
    PAGED_ATTENTION_QUICK_BATCHES, (4096,), (64,), PAGED_ATTENTION_DTYPES, ("bfloat16",)
)

# ---------------------------------------------------------------------------------------------- paged KV cache write
# New tokens' K/V written to their slots (benchmarks/ops/kv_cache.py), with or without RoPE fused, at the attention
# layers of ROTARY_MODELS: decode batches (one token per sequence) and one prefill chunk; bf16 and fp8 caches of
# KV_CACHE_SLOTS rows in pages of KV_CACHE_PAGE.
KV_CACHE_DECODE_TOKENS = (1, 8, 64, 256)
KV_CACHE_PREFILL_TOKENS = (2048,)
KV_CACHE_PAGE = 16
KV_CACHE_SLOTS = 16384
KV_CACHE = tuple(
    shape
    for model, dims in ROTARY_MODELS.items()
    for dtype in ("bfloat16", "float8_e4m3fn")
    for phase, tokens in (("decode", KV_CACHE_DECODE_TOKENS), ("prefill", KV_CACHE_PREFILL_TOKENS))
    for shape in sweep(
        "tokens",
        tokens,
        dtype,
        model=model,
        phase=phase,
        q_heads=dims["q_heads"],
        kv_heads=dims["kv_heads"],
        head_dim=dims["head_dim"],
    )
)
# `make bench` (no --full): decode 8 and 256, and the prefill chunk.
KV_CACHE_QUICK = tuple(s for s in KV_CACHE if s.batch in (8, 256, 2048))

SHAPES: dict[str, tuple[Shape, ...]] = {
    "rms_norm": RMS_NORM,
    "ragged_dot": RAGGED_DOT,
    "moe": MOE,
    "rotary": ROTARY,
    "flash_attention": FLASH_ATTENTION,
    "paged_attention": PAGED_ATTENTION,
    "kv_cache": KV_CACHE,
}
