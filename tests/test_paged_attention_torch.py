"""Paged attention, torch side: ragged_paged_attention (mixed prefill chunks and decodes, shuffled pages, lengths that
are not multiples of the page, empty and padding sequences, GQA, window, softcap, sinks, fp8 caches with scales),
flash-attn's flash_attn_with_kvcache (paged and non-paged caches written in place: same storage, exactly the new
slots changed; rotary interleaved or not, on q rows per position or at the cache length) and
flash_attn_varlen_func(..., block_table=) against torch references; opcheck / fake / torch.compile; the op's JAX
function exported for TPU; bad input; and transformers' continuous batching (generate_batch) on tiny random Qwen3 and
Gemma 4 models with the Hub build's attention, greedy tokens equal to plain generate with "sdpa".

Sizes are tiny: every new shape is a compile of the Pallas kernels in interpret mode (seconds each)."""

import collections

import ladder
import numpy as np
import pytest
import tiny_models
import torch
from hub import REPO_ID
from torch.utils._python_dispatch import TorchDispatchMode

import tpu_kernels
from tpu_kernels import paged_attention_ops as pa

PAGE = 16
# What transformers 5.22.2's continuous batching accepts for a Hub kernel: the kernel name alone is refused (no
# "flash" in it); any ":function" suffix passes its check, and the kernel is still wrapped by transformers' own
# flash_attention_forward over flash_attn_varlen_func.
CB_IMPLEMENTATION = f"{REPO_ID}:flash_attn_varlen_func"


def _randn(rand, *shape, dtype=torch.float32, scale=1.0):
    return (torch.from_numpy(rand.rng.standard_normal(shape, dtype="float32")) * scale).to(dtype)


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).clone()


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


class _OpTrace(TorchDispatchMode):
    """The ops a call dispatches, by name without namespace and overload (a custom op's inner calls run beneath it)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func).split(".")[-2])
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------------ references
def _attend(q, k, v, *, scale, causal, window, softcap, sinks):
    """flash-attn's semantics in torch f32 for one sequence: q [n, Hq, D] the last n positions of k / v [L, Hkv, D]."""
    n, length, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    row = torch.arange(n)[:, None] + length - n
    col = torch.arange(length)[None, :]
    allowed = torch.ones(n, length, dtype=torch.bool)
    left, right = window[0], 0 if causal else window[1]
    if left >= 0:
        allowed &= col >= row - left
    if right >= 0:
        allowed &= col <= row + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
    empty = torch.isinf(scores).all(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(empty, 0.0, scores), dim=-1)[..., :length] * allowed
    return torch.einsum("hqk,khd->qhd", probs, v)


def _torch_paged(
    q,
    k_cache,
    v_cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs=None,
    *,
    softmax_scale=None,
    causal=True,
    window_size=(-1, -1),
    softcap=0.0,
    sinks=None,
    k_scale=None,
    v_scale=None,
):
    """ragged paged attention in torch: each sequence's pages gathered into its context, then _attend."""
    n = kv_lens.shape[0] if num_seqs is None else int(torch.as_tensor(num_seqs).reshape(-1)[0])
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    for s in range(n):
        start, end, length = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        if end == start:
            continue
        pages = page_indices[s, : -(-length // k_cache.shape[1])].long()
        k, v = (c[pages].reshape(-1, *c.shape[2:])[:length].float() for c in (k_cache, v_cache))
        k, v = k * (1.0 if k_scale is None else float(k_scale)), v * (1.0 if v_scale is None else float(v_scale))
        out[start:end] = _attend(
            q[start:end], k, v, scale=scale, causal=causal, window=window_size, softcap=softcap, sinks=sinks
        )
    return out.to(q.dtype)


def _rope(x, cos, sin, positions, interleaved):
    """flash-attn's rotary on x [B, S, H, D] with half-width tables [seqlen_ro, r / 2] at positions [B, S], f32."""
    c, s = cos[positions].float()[:, :, None, :], sin[positions].float()[:, :, None, :]
    r = 2 * cos.shape[1]
    xf = x.float()
    rot, rest = xf[..., :r], xf[..., r:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot, rest], dim=-1).to(x.dtype)


# --------------------------------------------------------------------------------------------- ragged batches
def _ragged_batch(rand, *, q_lens, kv_lens, hq=4, hkv=2, d=64, dv=64, dtype=torch.float32, spare_pages=3, pad=0):
    """A mixed batch over shuffled pages; pages no sequence uses are NaN (a read of them would show), unused table
    entries -1 (transformers' block tables)."""
    need = [-(-n // PAGE) for n in kv_lens]
    num_pages = sum(need) + spare_pages
    order = rand.rng.permutation(num_pages)
    table = np.full((len(kv_lens), max(need) + 1), -1, dtype=np.int32)
    used, at = [], 0
    for s, count in enumerate(need):
        table[s, :count] = order[at : at + count]
        used.extend(order[at : at + count])
        at += count
    k_cache = _randn(rand, num_pages, PAGE, hkv, d, dtype=dtype)
    v_cache = _randn(rand, num_pages, PAGE, hkv, dv, dtype=dtype)
    unused = np.setdiff1d(np.arange(num_pages), used)
    k_cache[unused], v_cache[unused] = float("nan"), float("nan")
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return {
        "q": _randn(rand, int(cu[-1]) + pad, hq, d, dtype=dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "kv_lens": _int32(kv_lens),
        "page_indices": torch.from_numpy(table),
        "cu_q_lens": torch.from_numpy(cu),
    }


MIXED = {"q_lens": (5, 1, 0, 1, 9), "kv_lens": (21, 16, 7, 40, 9)}  # a chunk, decodes, an empty and a fresh prompt

# f32 with no option: num_seqs_tensor_padding (its options are the defaults) and flash_attn_varlen_func's block-table
# test, over the same batch.
RAGGED_CASES = {
    "bf16_window_softcap_sinks": {
        "dtype": torch.bfloat16,
        "options": {"window_size": (6, 0), "softcap": 3.0, "softmax_scale": 0.3},
        "sinks": True,
    },
    "num_seqs_tensor_padding": {"num_seqs": torch.tensor([4], dtype=torch.int32), "pad": 3},
    "int64_metadata_non_causal_int_num_seqs": {"int64": True, "num_seqs": 5, "options": {"causal": False}},
}


@pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
def test_ragged_paged_attention_matches_torch(rand, case):
    spec = RAGGED_CASES[case]
    dtype = spec.get("dtype", torch.float32)
    args = _ragged_batch(rand, **MIXED, dtype=dtype, pad=spec.get("pad", 0))
    if spec.get("int64"):
        args = {k: v.long() if k in ("kv_lens", "page_indices", "cu_q_lens") else v for k, v in args.items()}
    options = dict(spec.get("options", {}))
    if spec.get("sinks"):
        options["sinks"] = _randn(rand, 4)
    num_seqs = spec.get("num_seqs")
    out = tpu_kernels.paged_attention_ops.ragged_paged_attention(**args, num_seqs=num_seqs, **options)
    expected = _torch_paged(**args, num_seqs=num_seqs, **options)
    assert out.dtype == dtype and out.shape == expected.shape
    assert not torch.isnan(out).any(), f"{rand!r}"
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol, msg=lambda m: f"{m} ({rand!r})")
    if num_seqs is not None and not isinstance(num_seqs, int):  # sequences past num_seqs and padding rows: zeros
        live = int(args["cu_q_lens"][int(num_seqs[0])])
        assert torch.equal(out[live:], torch.zeros_like(out[live:]))


def test_ragged_paged_attention_fp8_cache(rand):
    """float8_e4m3fn caches with tensor / float scales: stored * scale read back, as the reference dequantises."""
    args = _ragged_batch(rand, **MIXED, dtype=torch.bfloat16, spare_pages=0)
    k_scale, v_scale = torch.tensor([0.05]), 0.2
    args["k_cache"] = (args["k_cache"].float() / k_scale).to(torch.float8_e4m3fn)
    args["v_cache"] = (args["v_cache"].float() / v_scale).to(torch.float8_e4m3fn)
    out = pa.ragged_paged_attention(**args, k_scale=k_scale, v_scale=v_scale)
    expected = _torch_paged(**args, k_scale=k_scale, v_scale=v_scale)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"{m} ({rand!r})")


def _op_args(rand, dtype=torch.float32):
    a = _ragged_batch(rand, q_lens=(3, 1), kv_lens=(19, 7), d=32, dv=32, dtype=dtype, spare_pages=0)
    args = (a["q"], a["k_cache"], a["v_cache"], a["kv_lens"], a["page_indices"], a["cu_q_lens"])
    return args + (None, _randn(rand, 4), None, None, 0.2, True, -1, -1, 0.0, "")


def test_ragged_op_checks(rand):
    """opcheck (schema, fake, AOT dispatch), fake / meta shapes and torch.compile(fullgraph) of the op."""
    ladder.check_torch_op(pa.ragged_paged_attention_op, _op_args(rand), expected_shapes=[(4, 4, 32)])


def test_ragged_op_function_exports_for_tpu(rand):
    """What TorchTPU's jax_op exports on `tpu` tensors: the op's JAX function holds the Mosaic kernel."""
    ladder.export_torch_op_for_tpu(pa.ragged_paged_attention_op, _op_args(rand, torch.bfloat16))


def test_ragged_wrapper_under_torch_compile(rand):
    args = _ragged_batch(rand, q_lens=(3, 1), kv_lens=(19, 7), d=32, dv=32, spare_pages=0)
    blocks = pa.PagedAttentionBlocks(queries_per_block=8)
    ladder.check_compiled_matches_eager(
        lambda **a: pa.ragged_paged_attention(**a, window_size=(4, 0), blocks=blocks), args, rand=rand
    )


# ------------------------------------------------------------------------------------------ flash_attn_with_kvcache
def _kvcache_case(rand, *, batch, seqlen_q, new, lengths, paged, dtype, hq=4, hkv=2, d=64, rotary_dim=None):
    """Caches (paged: shuffled pages; non-paged: batch + 1 rows of 48), poisoned NaN outside the live contexts, the
    new k / v and cache_seqlens; rotary tables when rotary_dim is given."""
    if paged:
        need = [-(-(n + new) // PAGE) for n in lengths]
        num_pages = sum(need) + 2
        order = rand.rng.permutation(num_pages)
        table = np.full((batch, max(need) + 1), -1, dtype=np.int32)
        at = 0
        for b, count in enumerate(need):
            table[b, :count] = order[at : at + count]
            at += count
        shape = (num_pages, PAGE, hkv, d)
    else:
        table, shape = None, (batch + 1, 48, hkv, d)
    k_cache, v_cache = _randn(rand, *shape, dtype=dtype), _randn(rand, *shape, dtype=dtype)
    for cache in (k_cache, v_cache):  # NaN everywhere a sequence's context does not reach
        flat = cache.view(-1, hkv, d) if paged else cache
        poison = torch.ones(flat.shape[:-2] if not paged else flat.shape[:1], dtype=torch.bool)
        for b, n in enumerate(lengths):
            rows = _context_rows(table, b, n + new, shape[1]) if paged else (b, slice(0, n + new))
            poison[rows] = False
        flat[poison] = float("nan")
    case = {
        "q": _randn(rand, batch, seqlen_q, hq, d, dtype=dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "k": _randn(rand, batch, new, hkv, d, dtype=dtype) if new else None,
        "v": _randn(rand, batch, new, hkv, d, dtype=dtype) if new else None,
        "cache_seqlens": _int32(lengths),
        "block_table": None if table is None else torch.from_numpy(table),
    }
    if rotary_dim:
        angles = torch.arange(64)[:, None] * (1e-2 ** (torch.arange(rotary_dim // 2) / (rotary_dim // 2)))[None, :]
        case["rotary_cos"], case["rotary_sin"] = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    return case


def _context_rows(table, b, length, page):
    positions = np.arange(length)
    return table[b, positions // page] * page + positions % page


def _torch_kvcache(case, *, causal, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True):
    """flash_attn_with_kvcache in torch on copies: rotary, the write at cache_seqlens, then attention. Returns
    (out, k_cache, v_cache)."""
    q, k, v, lengths = case["q"], case["k"], case["v"], case["cache_seqlens"].long()
    k_cache, v_cache, table = case["k_cache"].clone(), case["v_cache"].clone(), case["block_table"]
    batch, seqlen_q = q.shape[:2]
    new = 0 if k is None else k.shape[1]
    if case.get("rotary_cos") is not None:
        per_row = causal or tuple(window_size) != (-1, -1)
        k_pos = lengths[:, None] + torch.arange(new)[None]
        q_pos = lengths[:, None] + (torch.arange(seqlen_q)[None] if per_row else torch.zeros(1, seqlen_q).long())
        cos, sin = case["rotary_cos"], case["rotary_sin"]
        q, k = _rope(q, cos, sin, q_pos, rotary_interleaved), _rope(k, cos, sin, k_pos, rotary_interleaved)
    outs = []
    for b in range(batch):
        total = int(lengths[b]) + new
        if table is None:
            if new:
                k_cache[b, lengths[b] : total], v_cache[b, lengths[b] : total] = k[b], v[b]
            kb, vb = k_cache[b, :total], v_cache[b, :total]
        else:
            rows = torch.from_numpy(_context_rows(table.numpy(), b, total, PAGE)).long()
            flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
            if new:
                flat_k[rows[-new:]], flat_v[rows[-new:]] = k[b], v[b]
            kb, vb = flat_k[rows], flat_v[rows]
        scale = q.shape[-1] ** -0.5
        outs.append(_attend(q[b], kb, vb, scale=scale, causal=causal, window=window_size, softcap=softcap, sinks=None))
    return torch.stack(outs).to(q.dtype), k_cache, v_cache


KVCACHE_CASES = {
    # transformers' decode: one new token per sequence, paged, causal
    "paged_decode_f32": dict(batch=3, seqlen_q=1, new=1, lengths=(20, 0, 37), paged=True, dtype=torch.float32),
    # a chunk of 3 with rotary (GPT-NeoX halves, partial rotary_dim), a window and a softcap, bf16
    "paged_chunk_rotary_window_bf16": dict(
        batch=2,
        seqlen_q=3,
        new=3,
        lengths=(13, 30),
        paged=True,
        dtype=torch.bfloat16,
        rotary_dim=32,
        options={"causal": True, "window_size": (7, 0), "softcap": 4.0, "rotary_interleaved": False},
    ),
    # non-paged cache (batch + 1 rows of 48: viewed as pages of 48), interleaved rotary, non-causal: q at cache_seqlens
    "dense_rotary_non_causal": dict(
        batch=2, seqlen_q=2, new=2, lengths=(5, 40), paged=False, dtype=torch.float32, rotary_dim=64
    ),
    # no new tokens: attention over the cache as it is
    "paged_read_only": dict(batch=2, seqlen_q=2, new=0, lengths=(25, 9), paged=True, dtype=torch.float32),
}


@pytest.mark.parametrize("name", KVCACHE_CASES, ids=str)
def test_flash_attn_with_kvcache_matches_torch_and_writes_in_place(rand, name):
    spec = dict(KVCACHE_CASES[name])
    options = spec.pop("options", {"causal": name != "dense_rotary_non_causal"})
    case = _kvcache_case(rand, **spec)
    out_ref, k_ref, v_ref = _torch_kvcache(case, **options)
    before = [(c.data_ptr(), _bits(c)) for c in (case["k_cache"], case["v_cache"])]

    with _OpTrace() as trace:
        out = pa.flash_attn_with_kvcache(**case, **options)
    assert out.dtype == case["q"].dtype and not torch.isnan(out).any(), f"{rand!r}"
    if spec.get("rotary_dim"):
        # RoPE of the new k in the kernel that writes it: the fused op, no separate write; q rotates in it too when
        # its rows are the new keys' positions (the causal chunk), else (non-causal: q at cache_seqlens) by the
        # rotary op
        assert trace.names.count("rope_and_reshape_and_cache_flash") == 1, trace.names
        assert "reshape_and_cache_flash" not in trace.names
        assert trace.names.count("apply_rotary") == (0 if options.get("causal") else 1), trace.names
    tol = 2e-2 if spec["dtype"] == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=tol, atol=tol, msg=lambda m: f"{m} ({rand!r})")
    for cache, expected, (pointer, bits) in zip((case["k_cache"], case["v_cache"]), (k_ref, v_ref), before):
        assert cache.data_ptr() == pointer, "the caller's cache keeps its storage"
        changed = (_bits(cache) != bits).reshape(-1, *cache.shape[2:]).any(-1).any(-1)
        written = (_bits(expected) != bits).reshape(-1, *cache.shape[2:]).any(-1).any(-1)
        assert torch.equal(changed, written), "exactly the new tokens' slots change"
        assert int(written.sum()) == spec["batch"] * spec["new"]
        torch.testing.assert_close(cache.float(), expected.float(), rtol=tol, atol=tol, equal_nan=True)


def test_flash_attn_with_kvcache_int_seqlens_and_compile(rand):
    """cache_seqlens as a Python int (flash-attn accepts one), eager and under torch.compile(fullgraph) give the same
    output and the same caches; with rotary, so the fused RoPE + write op runs under torch.compile too."""
    case = _kvcache_case(
        rand, batch=2, seqlen_q=1, new=1, lengths=(17, 17), paged=True, dtype=torch.float32, rotary_dim=32
    )
    case["cache_seqlens"] = 17
    eager = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    compiled = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = pa.flash_attn_with_kvcache(**eager, causal=True)
    torch._dynamo.reset()
    out_c = torch.compile(pa.flash_attn_with_kvcache, fullgraph=True, backend="aot_eager")(**compiled, causal=True)
    torch.testing.assert_close(out_c, out, rtol=0, atol=0)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(_bits(compiled[name]), _bits(eager[name]))
        assert not torch.equal(_bits(eager[name]), _bits(case[name]))


# ------------------------------------------------------------------------------- flash_attn_varlen_func, block_table
def test_flash_attn_varlen_func_with_block_table(rand):
    """Paged prefill as flash-attn's varlen API takes it: k / v the paged caches, cu_seqlens_k the offsets of the
    context lengths (int64), sinks as s_aux, a softcap; routed to ragged_paged_attention."""
    a = _ragged_batch(rand, **MIXED)
    cu_k = torch.nn.functional.pad(torch.cumsum(a["kv_lens"].long(), 0), (1, 0))
    s_aux = _randn(rand, 4)
    out = tpu_kernels.flash_attn_varlen_func(
        a["q"],
        a["k_cache"],
        a["v_cache"],
        a["cu_q_lens"].long(),
        cu_k,
        max_seqlen_q=9,
        max_seqlen_k=torch.tensor(40),
        causal=True,
        softcap=2.5,
        block_table=a["page_indices"],
        s_aux=s_aux,
    )
    expected = _torch_paged(**a, softcap=2.5, sinks=s_aux)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5, msg=lambda m: f"{m} ({rand!r})")


# ------------------------------------------------------------------------------------------------------- bad input
def _ragged_good(rand):
    return _ragged_batch(rand, q_lens=(3, 1), kv_lens=(19, 7), d=32, dv=32, spare_pages=0)


BAD_RAGGED = [
    ladder.BadInput("requires_grad", lambda r: {"q": _randn(r, 4, 4, 32).requires_grad_()}, ValueError, "q: ragged"),
    ladder.BadInput("page_out_of_range", {"page_indices": _int32([[0, 9, -1], [2, -1, -1]])}, ValueError, "page_ind"),
    ladder.BadInput("kv_len_beyond_pages", {"kv_lens": _int32([19, 49])}, ValueError, "kv_lens: expected lengths"),
    ladder.BadInput("cu_not_increasing", {"cu_q_lens": _int32([0, 3, 2])}, ValueError, "cu_q_lens: expected non-dec"),
    ladder.BadInput("query_longer_than_context", {"kv_lens": _int32([2, 7])}, ValueError, "cu_q_lens: sequence 0"),
    ladder.BadInput("heads", lambda r: {"q": _randn(r, 4, 3, 32)}, ValueError, "q: expected a number of heads"),
    ladder.BadInput(
        "cache_dtype", lambda r: {"v_cache": _randn(r, 3, 16, 2, 32, dtype=torch.bfloat16)}, TypeError, "v_cache"
    ),
    ladder.BadInput("cache_shape", lambda r: {"v_cache": _randn(r, 3, 16, 4, 32)}, ValueError, "v_cache: expected"),
    ladder.BadInput(
        "page_size",
        lambda r: {"k_cache": _randn(r, 6, 8, 2, 32), "v_cache": _randn(r, 6, 8, 2, 32)},
        ValueError,
        "page size",
    ),
    ladder.BadInput("float_lens", {"kv_lens": torch.tensor([19.0, 7.0])}, TypeError, "kv_lens"),
    ladder.BadInput(
        "non_contiguous_cache",
        lambda r: {"k_cache": _randn(r, 3, 2, 16, 32).transpose(1, 2)},
        ValueError,
        "k_cache: expected a contiguous cache",
    ),
    ladder.BadInput(
        "fp8_without_scale",
        {
            "k_cache": torch.zeros(3, 16, 2, 32, dtype=torch.float8_e4m3fn),
            "v_cache": torch.zeros(3, 16, 2, 32, dtype=torch.float8_e4m3fn),
        },
        ValueError,
        "k_scale: expected a scale",
    ),
    ladder.BadInput("num_seqs", {"num_seqs": 3}, ValueError, "num_seqs: expected 0 to 2"),
    ladder.BadInput("blocks", {"blocks": {"queries_per_block": 8}}, TypeError, "blocks: expected a PagedAttention"),
    ladder.BadInput("scale", {"softmax_scale": 0.0}, ValueError, "softmax_scale"),
    ladder.BadInput("sinks_shape", lambda r: {"sinks": _randn(r, 2)}, ValueError, "sinks"),
    ladder.BadInput("device", {"kv_lens": torch.empty(2, dtype=torch.int32, device="meta")}, ValueError, "kv_lens"),
]


@ladder.bad_input_params(BAD_RAGGED)
def test_ragged_paged_attention_bad_input(rand, case):
    ladder.assert_clear_error(case, lambda a: pa.ragged_paged_attention(**a), _ragged_good(rand), rand)


def _kvcache_good(rand):
    case = _kvcache_case(rand, batch=2, seqlen_q=1, new=1, lengths=(20, 3), paged=True, dtype=torch.float32)
    case["causal"] = True
    return case


def _overlapping_caches(rand):
    flat = _randn(rand, 8 * PAGE, 2, 64)
    return {"k_cache": flat[: 6 * PAGE].view(6, PAGE, 2, 64), "v_cache": flat[PAGE : 7 * PAGE].view(6, PAGE, 2, 64)}


BAD_KVCACHE = [
    ladder.BadInput("cache_batch_idx", {"cache_batch_idx": _int32([1, 0])}, ValueError, "cache_batch_idx: indexing"),
    ladder.BadInput("cache_leftpad", {"cache_leftpad": _int32([0, 0])}, ValueError, "cache_leftpad: left-padded"),
    ladder.BadInput("alibi", lambda r: {"alibi_slopes": _randn(r, 4)}, ValueError, "alibi_slopes: ALiBi"),
    ladder.BadInput("lse", {"return_softmax_lse": True}, ValueError, "return_softmax_lse: returning the softmax"),
    ladder.BadInput("num_splits", {"num_splits": -1}, TypeError, "num_splits: expected an int >= 0"),
    ladder.BadInput("requires_grad", lambda r: {"q": _randn(r, 2, 1, 4, 64).requires_grad_()}, ValueError, "q: flash"),
    ladder.BadInput("k_without_v", {"v": None}, ValueError, "v: expected k and v together"),
    ladder.BadInput("rotary_without_k", lambda r: _rotary_only(r), ValueError, "rotary_cos: rotary embedding applies"),
    ladder.BadInput("seqlens_negative", {"cache_seqlens": _int32([20, -1])}, ValueError, "cache_seqlens: expected"),
    ladder.BadInput("seqlens_beyond_table", {"cache_seqlens": _int32([20, 48])}, ValueError, "cache_seqlens: seq"),
    ladder.BadInput("seqlens_shape", {"cache_seqlens": _int32([20])}, ValueError, "cache_seqlens: expected shape"),
    ladder.BadInput("seqlens_float", {"cache_seqlens": 2.0}, TypeError, "cache_seqlens: expected None, an int"),
    ladder.BadInput("block_out_of_range", {"block_table": _int32([[0, 1, -1], [99, -1, -1]])}, ValueError, "block_"),
    ladder.BadInput(
        "shared_slot",
        {"block_table": _int32([[0, 1, -1], [1, -1, -1]]), "cache_seqlens": _int32([20, 4])},
        ValueError,
        "block_table: two new tokens",
    ),
    ladder.BadInput("block_table_rows", {"block_table": _int32([[0, 1, 2]])}, ValueError, "block_table: expected [2"),
    ladder.BadInput("k_heads", lambda r: {"k": _randn(r, 2, 1, 4, 64)}, ValueError, "k: expected [2, new tokens"),
    ladder.BadInput("q_rank", lambda r: {"q": _randn(r, 2, 4, 64)}, ValueError, "q: expected [batch, seqlen_q"),
    ladder.BadInput("overlapping_caches", _overlapping_caches, ValueError, "v_cache: expected a tensor that shares"),
    ladder.BadInput(
        "dense_length",
        lambda r: {"block_table": None, "k_cache": _randn(r, 2, 40, 2, 64), "v_cache": _randn(r, 2, 40, 2, 64)},
        ValueError,
        "k_cache: a cache without block_table",
    ),
    ladder.BadInput(
        "rotary_too_short",
        lambda r: {"rotary_cos": torch.ones(8, 16), "rotary_sin": torch.ones(8, 16)},
        ValueError,
        "rotary_cos: expected a row per position",
    ),
    ladder.BadInput(
        "rotary_width",
        lambda r: {"rotary_cos": torch.ones(64, 40), "rotary_sin": torch.ones(64, 40)},
        ValueError,
        "rotary_cos: expected [seqlen_ro",
    ),
]


def _rotary_only(rand):
    return {"k": None, "v": None, "rotary_cos": torch.ones(64, 16), "rotary_sin": torch.ones(64, 16)}


@ladder.bad_input_params(BAD_KVCACHE)
def test_flash_attn_with_kvcache_bad_input(rand, case):
    good = _kvcache_good(rand)
    snapshot = [_bits(good[n]) for n in ("k_cache", "v_cache")]
    ladder.assert_clear_error(case, lambda a: pa.flash_attn_with_kvcache(**a), good, rand)
    for name, bits in zip(("k_cache", "v_cache"), snapshot):  # refused before anything was written
        assert torch.equal(_bits(good[name]), bits)


def _varlen_paged_good(rand):
    a = _ragged_good(rand)
    return {
        "q": a["q"],
        "k": a["k_cache"],
        "v": a["v_cache"],
        "cu_seqlens_q": a["cu_q_lens"],
        "cu_seqlens_k": _int32([0, 19, 26]),
        "max_seqlen_q": 3,
        "max_seqlen_k": 19,
        "causal": True,
        "block_table": a["page_indices"],
    }


BAD_VARLEN_PAGED = [
    ladder.BadInput("block_table_rank", {"block_table": _int32([0, 1])}, ValueError, "block_table: expected 2 dim"),
    ladder.BadInput("block_table_rows", {"block_table": _int32([[0, 1]])}, ValueError, "block_table: expected 2 rows"),
    ladder.BadInput("cu_k_decreasing", {"cu_seqlens_k": _int32([0, 19, 10])}, ValueError, "cu_seqlens_k: expected n"),
    ladder.BadInput("kv_beyond_pages", {"cu_seqlens_k": _int32([0, 49, 56]), "max_seqlen_k": 49}, ValueError, "cu_s"),
    ladder.BadInput("page_out_of_range", {"block_table": _int32([[0, 7], [2, -1]])}, ValueError, "block_table: exp"),
    ladder.BadInput("max_seqlen_k", {"max_seqlen_k": 7}, ValueError, "max_seqlen_k: expected at least"),
    ladder.BadInput("requires_grad", lambda r: {"q": _randn(r, 4, 4, 32).requires_grad_()}, ValueError, "inference"),
    ladder.BadInput("dropout", {"dropout_p": 0.1}, ValueError, "dropout_p"),
]


@ladder.bad_input_params(BAD_VARLEN_PAGED)
def test_flash_attn_varlen_func_block_table_bad_input(rand, case):
    ladder.assert_clear_error(case, lambda a: tpu_kernels.flash_attn_varlen_func(**a), _varlen_paged_good(rand), rand)


# --------------------------------------------------------------------------------------------------- transformers
MODELS = {
    "qwen3": tiny_models.qwen3,
    # transformers 5.22.2's paged cache takes one head dim for every layer type: Gemma 4's sliding and full layers
    # get the same here (its own continuous batching fails on different ones, with "sdpa" too)
    "gemma4": lambda seed: tiny_models.gemma4(seed, global_head_dim=128),
}
PROMPT_LENGTHS = (7, 20, 3)  # 20 is longer than a page and than Gemma 4's sliding window of 8
NEW_TOKENS = 2  # the prompts, then a decode step of the three sequences: further steps are more decode steps


@pytest.fixture(scope="module")
def hub_kernels(hub_root):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCAL_KERNELS", f"{REPO_ID}={hub_root}")
        yield hub_root


def _counting(patch, module, name, calls):
    op = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return op(*args, **kwargs)

    patch.setattr(module, name, counted)


@pytest.mark.parametrize("model_name", MODELS)
def test_generate_batch_on_our_attention(rand, model_name, hub_kernels, tmp_path):
    """model.generate_batch with attn_implementation "kernels-community/tpu-kernels:flash_attn_varlen_func" (pages
    of 16, so prompts span pages): every attention call of every step (counted on the attention modules, in
    transformers' generation thread) runs our flash attention varlen op, and the greedy tokens are plain generate's
    with "sdpa". transformers writes the paged cache itself (index_copy_) and gathers each sequence's K/V for
    flash_attn_varlen_func; its decode fast path (flash_attn_with_kvcache) is enabled on CUDA / XPU only."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import kernels

    MODELS[model_name](rand.seed).save_pretrained(tmp_path / model_name)
    load = AutoModelForCausalLM.from_pretrained
    reference = load(tmp_path / model_name, attn_implementation="sdpa", dtype=torch.float32).eval()
    ours = load(tmp_path / model_name, attn_implementation=CB_IMPLEMENTATION, dtype=torch.float32).eval()
    kernel = kernels.get_kernel(REPO_ID, version=1)
    prompts = [rand.rng.integers(1, tiny_models.VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    # no end-of-sequence token: every request generates NEW_TOKENS tokens in both runs
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        expected = [
            reference.generate(torch.tensor([p]), generation_config=config)[0, len(p) :].tolist() for p in prompts
        ]

    calls = collections.Counter()
    hooks = [
        layer.self_attn.register_forward_hook(lambda *a: calls.update(["attention"])) for layer in ours.model.layers
    ]
    with pytest.MonkeyPatch.context() as patch:
        _counting(patch, kernel.flash_attention_ops, "flash_attention_varlen_op", calls)
        _counting(patch, kernel.flash_attention_ops, "flash_attention_op", calls)
        _counting(patch, kernel.paged_attention_ops, "ragged_paged_attention_op", calls)
        outputs = ours.generate_batch(
            prompts,
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, max_batch_tokens=64),
        )
    for hook in hooks:
        hook.remove()
    generated = [outputs[key].generated_tokens for key in sorted(outputs, key=lambda k: int(k.split("_")[-1]))]
    assert generated == expected
    layers = ours.config.num_hidden_layers
    assert calls["attention"] >= layers * NEW_TOKENS and calls["attention"] % layers == 0
    assert dict(calls) == {"attention": calls["attention"], "flash_attention_varlen_op": calls["attention"]}
