"""The KV cache write, torch side: reshape_and_cache_flash updates the caller's caches in place (same storage,
exactly the named slots changed), fp8 caches (float8_e4m3fn and vLLM's uint8) with tensor scales, the mutating op's
opcheck / fake / meta / torch.compile, the functional op underneath, bad input, and the export of the op's JAX
function for TPU (what TorchTPU's jax_op runs with the caches donated)."""

import ladder
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tpu_kernels
from tpu_kernels import kv_cache_ops

OP = kv_cache_ops.reshape_and_cache_flash_op
FUSED_OP = kv_cache_ops.rope_and_reshape_and_cache_flash_op
FP8_MAX = 448.0


def _randn(rand, *shape, dtype=torch.float32, scale=1.0):
    return (torch.from_numpy(rand.rng.standard_normal(shape, dtype="float32")) * scale).to(dtype)


def _slots(rand, tokens, num_slots, skip=0, dtype=torch.int64):
    slots = rand.rng.permutation(num_slots)[:tokens]
    if skip:
        slots[rand.rng.choice(tokens, skip, replace=False)] = -1
    return torch.from_numpy(slots).to(dtype)


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).clone()


def _reference(cache, rows, slots, scale=None):
    """The cache after the write, in torch: rows at their slots (fp8: rows / scale saturated and rounded)."""
    flat = cache.clone().reshape((-1,) + tuple(cache.shape[2:]))
    live = slots >= 0
    if cache.dtype == torch.float8_e4m3fn:
        rows = (rows.float() / scale.float().reshape(())).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    flat[slots[live]] = rows[live].to(cache.dtype)
    return flat.reshape(cache.shape)


def _untouched(num_slots, slots):
    return np.setdiff1d(np.arange(num_slots), slots[slots >= 0].numpy())


# Each cache dtype and each slot dtype once: the slot conversion does not depend on the cache dtype.
@pytest.mark.parametrize("dtype,slot_dtype", [(torch.bfloat16, torch.int64), (torch.float32, torch.int32)], ids=str)
def test_writes_in_place_exactly_the_named_slots(rand, dtype, slot_dtype):
    pages, page_size, heads, d, dv, tokens = 6, 16, 4, 128, 64, 37
    key_cache = torch.full((pages, page_size, heads, d), float("nan"), dtype=dtype)
    value_cache = _randn(rand, pages, page_size, heads, dv, dtype=dtype, scale=3.0)
    key, value = _randn(rand, tokens, heads, d, dtype=dtype), _randn(rand, tokens, heads, dv, dtype=dtype)
    slots = _slots(rand, tokens, pages * page_size, skip=4, dtype=slot_dtype)
    before = [(c.data_ptr(), _bits(c)) for c in (key_cache, value_cache)]
    expected = [_reference(key_cache, key, slots), _reference(value_cache, value, slots)]

    result = tpu_kernels.kv_cache_ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", None)
    assert result is None
    for cache, exp, (pointer, bits) in zip((key_cache, value_cache), expected, before):
        assert cache.data_ptr() == pointer, "the caller's cache keeps its storage"
        assert torch.equal(_bits(cache), _bits(exp)), f"{rand!r}"
        untouched = _untouched(pages * page_size, slots)
        flat, flat_before = _bits(cache).reshape(pages * page_size, -1), bits.reshape(pages * page_size, -1)
        assert torch.equal(flat[untouched], flat_before[untouched])
        assert not torch.isnan(cache.reshape(pages * page_size, -1)[slots[slots >= 0]].float()).any()


# Each cache dtype and each scale shape once: the scale is reshaped the same way for either cache.
@pytest.mark.parametrize(
    "scale_shape,cache_dtype",
    [((), torch.float8_e4m3fn), ((1,), torch.uint8)],
    ids=lambda v: str(v) if isinstance(v, torch.dtype) else f"scale{list(v)}",
)
def test_fp8_caches_with_tensor_scales(rand, cache_dtype, scale_shape):
    """kv_cache_dtype "fp8": float8_e4m3fn caches, or vLLM's uint8 ones holding e4m3 bits; the stored values are
    value / scale rounded (to one fp8 step of the torch formula), every other byte unchanged."""
    pages, page_size, heads, d, tokens = 5, 16, 2, 128, 30
    raw = [torch.from_numpy(rand.rng.integers(0, 255, (pages, page_size, heads, d), dtype=np.uint8)) for _ in range(2)]
    raw = [r & 0x77 for r in raw]  # finite e4m3 bit patterns (no NaN), so the untouched check compares values too
    caches = [r.clone() if cache_dtype == torch.uint8 else r.clone().view(torch.float8_e4m3fn) for r in raw]
    key, value = _randn(rand, tokens, heads, d, dtype=torch.bfloat16), _randn(rand, tokens, heads, d, scale=5.0)
    value = value.to(torch.bfloat16)
    k_scale, v_scale = torch.full(scale_shape, 0.03), torch.full(scale_shape, 0.11)
    slots = _slots(rand, tokens, pages * page_size, skip=3)
    pointers = [c.data_ptr() for c in caches]

    kv_cache_ops.reshape_and_cache_flash(key, value, *caches, slots, "fp8", k_scale, v_scale)
    for cache, r, rows, scale, pointer in zip(caches, raw, (key, value), (k_scale, v_scale), pointers):
        assert cache.data_ptr() == pointer and cache.dtype == cache_dtype
        stored = cache.view(torch.float8_e4m3fn)
        expected = _reference(r.view(torch.float8_e4m3fn), rows, slots, scale)
        torch.testing.assert_close(stored.float(), expected.float(), rtol=2**-3, atol=2**-9)
        untouched = _untouched(pages * page_size, slots)
        assert torch.equal(
            _bits(stored).reshape(pages * page_size, -1)[untouched], r.reshape(pages * page_size, -1)[untouched]
        )


def _op_args(rand, dtype=torch.bfloat16, fp8=False):
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    caches = [torch.zeros((4, 16, 2, 128), dtype=torch.float32).to(cache_dtype) for _ in range(2)]
    key, value = _randn(rand, 9, 2, 128, dtype=dtype), _randn(rand, 9, 2, 128, dtype=dtype)
    slots = _slots(rand, 9, 64, skip=2, dtype=torch.int32)
    return (key, value, *caches, slots, "fp8" if fp8 else "auto", torch.full((1,), 0.5), torch.full((1,), 0.25))


def _fused_op_args(rand):
    """The fused op's arguments: reshape_and_cache_flash's with a query, its output tensor, flash-attn's half-width
    rotary tables (rotary_dim 64 of 128) and each token's position, GPT-NeoX halves."""
    key, value, key_cache, value_cache, slots, *_ = _op_args(rand)
    query = _randn(rand, 9, 4, 128, dtype=torch.bfloat16)
    tables = [_randn(rand, 40, 32, dtype=torch.bfloat16) for _ in range(2)]
    positions = torch.from_numpy(rand.rng.integers(0, 40, 9)).to(torch.int32)
    ones = torch.ones((1,))
    return (query, key, value, torch.empty_like(query), key_cache, value_cache, slots, *tables, positions), (
        False,
        "auto",
        ones,
        ones,
    )


def test_mutating_op_checks(rand):
    """opcheck of the ops that declare their mutation (schema: the caches are mutated and nothing else; the fused
    op's query output too; fake; AOT dispatch with functionalization), their meta calls, and the functional op
    underneath the write (fake and meta shapes, torch.compile)."""
    args = _op_args(rand)
    assert "Tensor(a!) key_cache" in str(OP._opoverload._schema) and "-> ()" in str(OP._opoverload._schema)
    torch.library.opcheck(OP, args)  # bf16: the fake and meta kernels are dtype-blind (f32 runs in the write test)
    assert OP(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)) is None
    ladder.check_torch_op(OP.functional_op, args, expected_shapes=[(4, 16, 2, 128)] * 2)
    tensors, static = _fused_op_args(rand)
    schema = str(FUSED_OP._opoverload._schema)
    assert "Tensor(a!) query_out" in schema and "Tensor(c!) value_cache" in schema and "-> ()" in schema
    torch.library.opcheck(FUSED_OP, (*tensors, *static))
    assert FUSED_OP(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in (*tensors, *static))) is None


def test_wrapper_under_fake_tensors_and_torch_compile(rand):
    args = _op_args(rand)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        kv_cache_ops.reshape_and_cache_flash(*fake)

    eager = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    compiled = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    kv_cache_ops.reshape_and_cache_flash(*eager)
    torch._dynamo.reset()
    torch.compile(kv_cache_ops.reshape_and_cache_flash, fullgraph=True, backend="aot_eager")(*compiled)
    for e, c in zip(eager[2:4], compiled[2:4]):
        assert torch.equal(_bits(c), _bits(e))
    written = eager[4][eager[4] >= 0].long()
    assert torch.equal(_bits(eager[2].reshape(64, 2, 128)[written]), _bits(eager[0][eager[4] >= 0]))


def _bad_good(rand):
    return dict(
        key=_randn(rand, 6, 2, 128, dtype=torch.bfloat16),
        value=_randn(rand, 6, 2, 128, dtype=torch.bfloat16),
        key_cache=torch.zeros((4, 16, 2, 128), dtype=torch.bfloat16),
        value_cache=torch.zeros((4, 16, 2, 128), dtype=torch.bfloat16),
        slot_mapping=torch.tensor([0, 5, -1, 63, 17, 18]),
        kv_cache_dtype="auto",
        k_scale=torch.ones(()),
        v_scale=torch.ones(()),
    )


def _fp8_caches():
    return dict(
        key_cache=torch.zeros((4, 16, 2, 128), dtype=torch.uint8),
        value_cache=torch.zeros((4, 16, 2, 128), dtype=torch.uint8),
        kv_cache_dtype="fp8",
    )


BAD = [
    ladder.BadInput(
        "requires_grad", lambda r: {"key": _randn(r, 6, 2, 128).requires_grad_()}, ValueError, "key: reshape_and"
    ),
    ladder.BadInput(
        "cache_requires_grad",
        {"value_cache": torch.zeros((4, 16, 2, 128), requires_grad=True)},
        ValueError,
        "inference only",
    ),
    ladder.BadInput("kv_cache_dtype", {"kv_cache_dtype": "fp8_e5m2"}, ValueError, "kv_cache_dtype: expected one of"),
    ladder.BadInput("fp8_cache_with_auto", _fp8_caches() | {"kv_cache_dtype": "auto"}, ValueError, "needs 'fp8'"),
    ladder.BadInput("fp8_without_scale", _fp8_caches() | {"k_scale": None}, ValueError, "k_scale: an fp8 cache"),
    ladder.BadInput("fp8_bf16_cache", {"kv_cache_dtype": "fp8"}, TypeError, "key_cache: kv_cache_dtype 'fp8' needs"),
    ladder.BadInput(
        "scale_dtype", _fp8_caches() | {"v_scale": torch.ones((1,), dtype=torch.float64)}, ValueError, "v_scale"
    ),
    ladder.BadInput("scale_shape", _fp8_caches() | {"k_scale": torch.ones((2,))}, ValueError, "one element"),
    ladder.BadInput(
        "scale_zero", _fp8_caches() | {"k_scale": torch.zeros(())}, ValueError, "k_scale: expected a finite"
    ),
    ladder.BadInput(
        "non_contiguous_cache",
        {"key_cache": torch.zeros((4, 2, 16, 128), dtype=torch.bfloat16).transpose(1, 2)},
        ValueError,
        "contiguous",
    ),
    ladder.BadInput("cache_dtype", {"value_cache": torch.zeros((4, 16, 2, 128))}, TypeError, "v_cache"),
    ladder.BadInput(
        "key_heads", lambda r: {"key": _randn(r, 6, 4, 128, dtype=torch.bfloat16)}, ValueError, "key: expected"
    ),
    ladder.BadInput("slot_out_of_range", {"slot_mapping": torch.tensor([0, 5, -1, 64, 17, 18])}, ValueError, "[0, 64)"),
    ladder.BadInput(
        "slot_int64_overflow", {"slot_mapping": torch.tensor([0, 5, -1, 2**40, 1, 2])}, ValueError, "int32"
    ),
    ladder.BadInput("slot_length", {"slot_mapping": torch.tensor([0, 5, -1])}, ValueError, "slot_mapping"),
    ladder.BadInput("slot_float", {"slot_mapping": torch.zeros(6)}, TypeError, "slot_mapping"),
    ladder.BadInput("not_a_tensor", {"value": np.zeros((6, 2, 128))}, TypeError, "value: expected a torch.Tensor"),
]


@ladder.bad_input_params(BAD)
def test_bad_input_is_a_clear_error(rand, case):
    ladder.assert_clear_error(case, lambda a: kv_cache_ops.reshape_and_cache_flash(**a), _bad_good(rand), rand)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_op_function_exports_for_tpu(rand, fp8):
    """What TorchTPU's jax_op exports on `tpu` tensors (the caches donated): the functional op's JAX function holds
    the Mosaic kernel."""
    ladder.export_torch_op_for_tpu(OP.functional_op, _op_args(rand, fp8=fp8))
    if not fp8:  # the fused RoPE + write (flash_attn_with_kvcache's rotary) likewise
        tensors, static = _fused_op_args(rand)
        ladder.export_torch_op_for_tpu(FUSED_OP.functional_op, (*tensors, *static))


def test_functional_op_donates_the_caches_to_torch_tpu():
    """On a `tpu` tensor the functional op is TorchTPU's jax_op with key_cache and value_cache donated (arguments 2 and
    3), so the kernel's aliasing reaches the device buffers; without torch-tpu it is a plain custom op."""
    from tpu_kernels import _op_registry

    for op, donated in ((OP, [2, 3]), (FUSED_OP, [3, 4, 5])):  # the fused op's query output and caches
        functional = op.functional_op
        if _op_registry.HAS_TORCH_TPU:
            assert list(functional._init_fn.donate_argnums) == donated
        else:
            assert not hasattr(functional._init_fn, "donate_argnums")
        assert op.jax_fn is functional.jax_fn
