"""Flash attention, torch side: the ops and their derived backward op (opcheck, fake/meta shapes, torch.compile, the
JAX functions exported for TPU), flash-attn 2's flash_attn_func / flash_attn_varlen_func against torch's own
autograd of the formula (GQA, causal bottom-right, windows, softcap, sinks as s_aux, Dv != D, packed sequences with
int64 cu_seqlens and tensor max_seqlen), bad input, and transformers: tiny random Qwen3, Gemma 4 (head dims 256 and
512, K = V, scaling 1) and gpt-oss (sinks, sliding window) models loaded with
attn_implementation="kernels-community/tpu-kernels" from the Hub build give eager's logits and greedy tokens (Gemma 4's
full batch, gpt-oss's padded batch, Qwen3's packed sequences and full batch) with every attention layer counted on our
op, a training step's gradients equal eager's, and attention_forward registered under AttentionInterface does the same.

Sizes are tiny: every new shape is a compile of the Pallas kernels in interpret mode (seconds each)."""

import collections
import contextlib

import ladder
import pytest
import tiny_models
import torch
from hub import REPO_ID
from torch.utils._python_dispatch import TorchDispatchMode

import tpu_kernels
from tpu_kernels import flash_attention_ops

DIRECT = "tpu_kernels_attention"  # a name of our own for attention_forward (no "flash": transformers would then
# look for a flash-attn package or Hub kernel under that name)


def _randn(rand, *shape, dtype=torch.float32, scale=1.0, requires_grad=False):
    t = (torch.from_numpy(rand.rng.standard_normal(shape, dtype="float32")) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def _torch_attention(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, s_aux=None):
    """flash-attn 2's semantics written out in torch, f32: q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D / Dv]. A row that
    sees no key outputs zeros (or, with a sink, zeros too: the sink has no value)."""
    sq, sk, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    kf, vf = (x.float().repeat_interleave(group, dim=2) for x in (k, v))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_size[0], 0 if causal else window_size[1]
    row = torch.arange(sq)[:, None] + sk - sq
    col = torch.arange(sk)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        allowed &= col >= row - left
    if right >= 0:
        allowed &= col <= row + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    if s_aux is not None:
        sinks = s_aux.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    empty = torch.isinf(scores).all(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(empty, 0.0, scores), dim=-1)[..., :sk] * allowed
    return torch.einsum("bhqk,bkhd->bqhd", probs, vf).to(q.dtype)


def _torch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = [
        _torch_attention(q[None, a:b], k[None, c:d], v[None, c:d], **options)[0]
        for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])
    ]
    return torch.cat(outs)


# ---------------------------------------------------------------------------------------------------------- ops
def _op_inputs(rand):
    q = _randn(rand, 2, 9, 4, 32, requires_grad=True)
    k, v = _randn(rand, 2, 11, 2, 32, requires_grad=True), _randn(rand, 2, 11, 2, 16, requires_grad=True)
    return q, k, v, _randn(rand, 4, requires_grad=True)


def test_flash_attention_derived_backward_op_checks(rand):
    """Only q asked for (frozen k, v and sinks): their gradients are not computed and come back empty."""
    q, k, v, sinks = (t.detach() for t in _op_inputs(rand))
    ladder.check_torch_op(
        flash_attention_ops.flash_attention_op.backward_op,
        (_randn(rand, 2, 9, 4, 16), q, k, v, sinks, 0.2, True, 4, 0, 0.0, "q"),
        expected_shapes=[(2, 9, 4, 32), (0,), (0,), (0,)],
    )


def _varlen_op_args(rand):
    q = _randn(rand, 20, 4, 32, requires_grad=True)
    k, v = _randn(rand, 23, 2, 32, requires_grad=True), _randn(rand, 23, 2, 32, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 5, 5, 20], dtype=torch.int32), torch.tensor([0, 7, 10, 23], dtype=torch.int32)
    return (q, k, v, cu_q, cu_k, None, 15, 13, 0.25, False, -1, -1, 5.0)


def test_op_functions_export_for_tpu(rand):
    """What jax_op exports on a `tpu` tensor: the forward and derived backward JAX functions of both ops (float16,
    run as float32) hold the Mosaic kernels."""
    q, k, v, sinks = (t.detach().half() for t in _op_inputs(rand))
    args = (q, k, v, sinks, 0.2, True, 4, 0, 0.0)
    ladder.export_torch_op_for_tpu(flash_attention_ops.flash_attention_op, args)
    grad = _randn(rand, 2, 9, 4, 16, dtype=torch.float16)
    ladder.export_torch_op_for_tpu(flash_attention_ops.flash_attention_op.backward_op, (grad, *args, "q,k,v,sinks"))
    varlen = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in _varlen_op_args(rand))
    ladder.export_torch_op_for_tpu(flash_attention_ops.flash_attention_varlen_op, varlen)


# ------------------------------------------------------------------------------------------- flash-attn 2's API
# GQA with causal masking, what transformers passes for a full-attention layer, is in the models below (Qwen3: 4
# query heads over 2 kv heads, causal) against eager, and in the cases here apart: GQA in the first, causal in the
# second.
DENSE_CASES = {
    # everything at once: GQA (4 query heads over 1 kv head), Dv != D, Sq != Sk, a two-sided window, softcap, sinks, an
    # explicit scale; a window of 6 keys, so the forward runs as a band (kernels/flash_attention/band.py)
    "window-softcap-sinks": dict(
        sq=9,
        sk=14,
        hq=4,
        hkv=1,
        d=32,
        dv=64,
        options=dict(window_size=(3, 2), softcap=5.0, softmax_scale=0.3),
        sinks=True,
    ),
    # bottom-right causal with more queries than keys: the first 7 rows see no key and are zeros
    "causal-rows-without-keys": dict(sq=12, sk=5, hq=2, hkv=2, d=16, dv=16, options=dict(causal=True), sinks=True),
}


@pytest.mark.parametrize("case", DENSE_CASES)
def test_flash_attn_func_and_autograd_match_torch(rand, case):
    """Outputs and gradients against torch's autograd of the formula; with every feature at once, also under
    torch.compile(fullgraph=True): the wrapper's checks and casts trace without a graph break, and the compiled
    results and gradients equal eager's exactly, and the op itself passes check_torch_op (opcheck, fake and meta
    shapes, torch.compile) with the arguments the wrapper gives it (on the shapes just run: no new kernel
    compiles)."""
    c = DENSE_CASES[case]
    inputs = {
        "q": _randn(rand, 2, c["sq"], c["hq"], c["d"], requires_grad=True),
        "k": _randn(rand, 2, c["sk"], c["hkv"], c["d"], requires_grad=True),
        "v": _randn(rand, 2, c["sk"], c["hkv"], c["dv"], requires_grad=True),
        **c["options"],
    }
    if c.get("sinks"):
        inputs["s_aux"] = _randn(rand, c["hq"], requires_grad=True)
    grads = ladder.check_torch_gradients(
        tpu_kernels.flash_attn_func, _torch_attention, inputs, rand=rand, rtol=1e-4, atol=1e-5
    )
    assert set(grads) == {"q", "k", "v"} | ({"s_aux"} if c.get("sinks") else set())
    if case == "causal-rows-without-keys":
        with torch.no_grad():
            out = tpu_kernels.flash_attn_func(inputs["q"], inputs["k"], inputs["v"], causal=True)
        assert (out[:, :7] == 0).all() and (out[:, 7:] != 0).any()
    else:
        ladder.check_compiled_matches_eager(lambda **a: tpu_kernels.flash_attn_func(**a), inputs, rand=rand)
        options = c["options"]
        ladder.check_torch_op(
            flash_attention_ops.flash_attention_op,
            (inputs["q"], inputs["k"], inputs["v"], inputs["s_aux"], options["softmax_scale"], False)
            + (*options["window_size"], options["softcap"]),
            expected_shapes=[(2, c["sq"], c["hq"], c["dv"])],
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_inputs(rand, dtype):
    """float16 runs as float32 and bfloat16 natively; both come back in q's dtype, within that dtype's rounding of
    the f32 result."""
    q, k, v = _randn(rand, 1, 8, 2, 32), _randn(rand, 1, 8, 1, 32), _randn(rand, 1, 8, 1, 32)
    out = tpu_kernels.flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
    assert out.dtype == dtype
    expected = _torch_attention(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), causal=True)
    jdtype = ladder.jnp.dtype(str(dtype).removeprefix("torch."))
    ladder.assert_close(out.float().numpy(), expected.numpy(), dtype=jdtype, context=repr(rand))


def _varlen_inputs(rand, index_dtype=torch.int64):
    """Three sequences, one of them empty, with more keys than queries (a cached prefix); transformers' data
    collators give int64 cu_seqlens and its packed-position path a 0-d tensor max_seqlen."""
    return {
        "q": _randn(rand, 17, 4, 32, requires_grad=True),
        "k": _randn(rand, 24, 2, 32, requires_grad=True),
        "v": _randn(rand, 24, 2, 32, requires_grad=True),
        "cu_seqlens_q": torch.tensor([0, 6, 6, 17], dtype=index_dtype),
        "cu_seqlens_k": torch.tensor([0, 9, 11, 24], dtype=index_dtype),
        "max_seqlen_q": torch.tensor(11, dtype=torch.int32),
        "max_seqlen_k": 13,
        "causal": True,
        "window_size": (4, -1),
        "softcap": 5.0,
        "softmax_scale": 0.25,
        "s_aux": _randn(rand, 4, requires_grad=True),
    }


def test_flash_attn_varlen_func_and_autograd_match_torch(rand):
    """Against torch's autograd of the formula; int32 cu_seqlens give the int64 result; under
    torch.compile(fullgraph=True) (int64 cu_seqlens, an int max_seqlen) the results and gradients are eager's; the op
    itself passes check_torch_op with the arguments the wrapper gives it (the kernels compiled above serve it)."""
    inputs = _varlen_inputs(rand)
    grads = ladder.check_torch_gradients(
        tpu_kernels.flash_attn_varlen_func, _torch_varlen, inputs, rand=rand, rtol=1e-4, atol=1e-5
    )
    assert set(grads) == {"q", "k", "v", "s_aux"}
    int32 = {**inputs, "cu_seqlens_q": inputs["cu_seqlens_q"].int(), "cu_seqlens_k": inputs["cu_seqlens_k"].int()}
    with torch.no_grad():
        torch.testing.assert_close(
            tpu_kernels.flash_attn_varlen_func(**int32), tpu_kernels.flash_attn_varlen_func(**inputs), rtol=0, atol=0
        )
    compiled = {**inputs, "max_seqlen_q": 11}
    ladder.check_compiled_matches_eager(lambda **a: tpu_kernels.flash_attn_varlen_func(**a), compiled, rand=rand)
    op_args = [inputs[name] for name in ("q", "k", "v")] + [int32["cu_seqlens_q"], int32["cu_seqlens_k"]]
    op_args += [inputs["s_aux"], 11, 13, 0.25, True, 4, -1, 5.0]
    ladder.check_torch_op(flash_attention_ops.flash_attention_varlen_op, tuple(op_args), expected_shapes=[(17, 4, 32)])


def test_meta_tensors_give_shapes_and_are_checked_by_shape(rand):
    """Meta (and fake) tensors have no values: the wrappers check shapes and dtypes, and return the output shape."""
    q, k, v = (torch.empty(s, device="meta") for s in ((2, 5, 4, 32), (2, 7, 2, 32), (2, 7, 2, 8)))
    assert tpu_kernels.flash_attn_func(q, k, v).shape == (2, 5, 4, 8)
    cu = torch.empty(3, dtype=torch.int64, device="meta")  # int64 cast without a value check
    out = tpu_kernels.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 7)
    assert out.shape == (5, 4, 8) and out.device.type == "meta"
    with pytest.raises(ValueError, match="k: expected the head dim of q"):
        tpu_kernels.flash_attn_func(q, torch.empty(2, 7, 2, 16, device="meta"), v)


# ---------------------------------------------------------------------------------------------------- bad input
def _dense(rand):
    return {"q": _randn(rand, 2, 6, 4, 32), "k": _randn(rand, 2, 6, 2, 32), "v": _randn(rand, 2, 6, 2, 32)}


BAD_DENSE_INPUTS = [
    ladder.BadInput("dropout", {"dropout_p": 0.1}, ValueError, "dropout_p: attention dropout is not implemented"),
    ladder.BadInput("alibi", {"alibi_slopes": torch.ones(4)}, ValueError, "alibi_slopes: ALiBi is not implemented"),
    ladder.BadInput("attention probabilities", {"return_attn_probs": True}, ValueError, "return_attn_probs:"),
    ladder.BadInput("deterministic not a bool", {"deterministic": None}, TypeError, "deterministic: expected a bool"),
    ladder.BadInput(
        "heads not a multiple of kv heads",
        lambda rand: {"q": _randn(rand, 2, 6, 3, 32)},
        ValueError,
        "q: expected a number of heads that is a multiple of k's 2 kv heads, got 3",
    ),
    ladder.BadInput(
        "head dim mismatch", lambda rand: {"k": _randn(rand, 2, 6, 2, 16)}, ValueError, "k: expected the head dim of q"
    ),
    ladder.BadInput(
        "v rows", lambda rand: {"v": _randn(rand, 2, 5, 2, 32)}, ValueError, "v: expected the leading dimensions of k"
    ),
    ladder.BadInput("window", {"window_size": (-2, 0)}, ValueError, "window_size: expected -1 (unbounded) or a size"),
    ladder.BadInput("window not a pair", {"window_size": 4}, TypeError, "window_size: expected a pair"),
    ladder.BadInput("nan scale", {"softmax_scale": float("nan")}, ValueError, "softmax_scale: expected a finite"),
    ladder.BadInput("zero scale", {"softmax_scale": 0.0}, ValueError, "softmax_scale: expected a finite number > 0"),
    ladder.BadInput("negative softcap", {"softcap": -1.0}, ValueError, "softcap: expected a finite number >= 0"),
    ladder.BadInput("causal not a bool", {"causal": "yes"}, TypeError, "causal: expected a bool"),
    ladder.BadInput("q rank", lambda rand: {"q": _randn(rand, 6, 4, 32)}, ValueError, "q: expected 4 dimensions"),
    ladder.BadInput("float64 q", lambda rand: {"q": _randn(rand, 2, 6, 4, 32).double()}, TypeError, "q: expected"),
    ladder.BadInput(
        "k dtype",
        lambda rand: {"k": _randn(rand, 2, 6, 2, 32, dtype=torch.bfloat16)},
        TypeError,
        "k: expected dtype in (float32)",
    ),
    ladder.BadInput(
        "integer q", {"q": torch.zeros(2, 6, 4, 32, dtype=torch.int32)}, TypeError, "q: expected dtype in ("
    ),
    ladder.BadInput(
        "sinks per kv head", lambda rand: {"s_aux": _randn(rand, 2)}, ValueError, "s_aux: expected shape (4,)"
    ),
    ladder.BadInput("sinks rank", lambda rand: {"s_aux": _randn(rand, 1, 4)}, ValueError, "s_aux: expected 1 dim"),
    ladder.BadInput("q not a tensor", {"q": [[0.5]]}, TypeError, "q: expected a torch.Tensor, got list"),
    ladder.BadInput(
        "k on another device",
        {"k": torch.empty(2, 6, 2, 32, device="meta")},
        ValueError,
        "k: expected a tensor on cpu",
    ),
]


@ladder.bad_input_params(BAD_DENSE_INPUTS)
def test_flash_attn_func_bad_input(rand, case):
    ladder.assert_clear_error(case, lambda a: tpu_kernels.flash_attn_func(**a), _dense(rand), rand)


def _cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def _varlen(rand):
    return {
        "q": _randn(rand, 10, 4, 32),
        "k": _randn(rand, 12, 2, 32),
        "v": _randn(rand, 12, 2, 32),
        "cu_seqlens_q": _cu(0, 4, 10),
        "cu_seqlens_k": _cu(0, 5, 12),
        "max_seqlen_q": 6,
        "max_seqlen_k": 7,
    }


BAD_VARLEN_INPUTS = [
    ladder.BadInput("block table", {"block_table": _cu(0, 1)}, ValueError, "block_table: expected 2 dimensions"),
    ladder.BadInput("dropout", {"dropout_p": 0.5}, ValueError, "dropout_p:"),
    ladder.BadInput(
        "float cu_seqlens",
        {"cu_seqlens_q": torch.tensor([0.0, 4.0, 10.0])},
        TypeError,
        "cu_seqlens_q: expected dtype in (int32)",
    ),
    ladder.BadInput(
        "decreasing cu_seqlens", {"cu_seqlens_q": _cu(0, 6, 4, 10)}, ValueError, "cu_seqlens_q: expected non-decreasing"
    ),
    ladder.BadInput(
        "cu_seqlens not at the token count",
        {"cu_seqlens_k": _cu(0, 5, 11)},
        ValueError,
        "cu_seqlens_k: expected to end at the token count 12, got 11",
    ),
    ladder.BadInput("cu_seqlens not from 0", {"cu_seqlens_q": _cu(1, 4, 10)}, ValueError, "cu_seqlens_q: expected to"),
    ladder.BadInput(
        "int64 cu_seqlens beyond int32",
        {"cu_seqlens_k": _cu(0, 1 << 33, 12, dtype=torch.int64)},
        ValueError,
        "cu_seqlens_k: expected int64 values that int32 can hold",
    ),
    ladder.BadInput(
        "sequence counts differ", {"cu_seqlens_k": _cu(0, 5, 6, 12)}, ValueError, "cu_seqlens_k: expected the shape"
    ),
    ladder.BadInput(
        "max_seqlen below the longest",
        {"max_seqlen_k": torch.tensor(6)},
        ValueError,
        "max_seqlen_k: expected at least the longest sequence, 7, got 6",
    ),
    ladder.BadInput(
        "float max_seqlen", {"max_seqlen_q": torch.tensor(6.0)}, TypeError, "max_seqlen_q: expected a Python int"
    ),
    ladder.BadInput("max_seqlen a float", {"max_seqlen_q": 6.0}, TypeError, "max_seqlen_q: expected a Python int"),
    ladder.BadInput("q rank", lambda rand: {"q": _randn(rand, 1, 10, 4, 32)}, ValueError, "q: expected 3 dimensions"),
    ladder.BadInput("heads", lambda rand: {"q": _randn(rand, 10, 5, 32)}, ValueError, "q: expected a number of heads"),
    ladder.BadInput("scale", {"softmax_scale": -1.0}, ValueError, "softmax_scale: expected a finite number > 0"),
    ladder.BadInput(
        "cu_seqlens on another device",
        {"cu_seqlens_k": torch.empty(3, dtype=torch.int32, device="meta")},
        ValueError,
        "cu_seqlens_k: expected a tensor on cpu",
    ),
]


@ladder.bad_input_params(BAD_VARLEN_INPUTS)
def test_flash_attn_varlen_func_bad_input(rand, case):
    ladder.assert_clear_error(case, lambda a: tpu_kernels.flash_attn_varlen_func(**a), _varlen(rand), rand)


# --------------------------------------------------------------------------------------------------- transformers
MODELS = {
    "qwen3": tiny_models.qwen3,
    # Gemma 4's attention: sliding layers of head dim 256, a full layer of head dim 512 with K = V, scaling 1.0
    "gemma4": lambda seed: tiny_models.gemma4(
        seed, head_dim=256, global_head_dim=512, attention_k_eq_v=True, num_global_key_value_heads=1
    ),
    "gpt_oss": tiny_models.gpt_oss,
}


class _OpCalls(TorchDispatchMode):
    """Counts the calls of a Hub build's attention ops (any build's namespace, not the checkout's) by op name: proof
    that a model's attention ran on the loaded kernels, not on a fallback."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func.name().partition("::")
        name = name.split(".")[0]
        build = namespace.startswith("_tpu_kernels_") and namespace != "_tpu_kernels_dev"
        if build and name in ("flash_attention", "flash_attention_varlen"):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def hub_kernels(hub_root):
    """transformers' get_kernel("kernels-community/tpu-kernels") loads the test build, offline."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCAL_KERNELS", f"{REPO_ID}={hub_root}")
        yield hub_root


def _load(path, implementation):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=implementation, dtype=torch.float32).eval()


def _models(name, seed, tmp_path, implementation):
    """The same random weights twice: eager, and with `implementation` (from_pretrained, as users load them)."""
    MODELS[name](seed).save_pretrained(tmp_path / name)
    return _load(tmp_path / name, "eager"), _load(tmp_path / name, implementation)


def _layers(model):
    return model.config.get_text_config().num_hidden_layers


def _assert_logits_close(actual, expected):
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@contextlib.contextmanager
def _counted(expected: dict | None = None):
    """Counts our attention ops' calls in the block (no_grad); with `expected`, asserts the counts by op."""
    mode = _OpCalls()
    with mode, torch.no_grad():
        yield mode.calls
    if expected is not None:
        assert dict(mode.calls) == expected, f"our attention ops ran {dict(mode.calls)}, expected {expected}"


# Gemma 4 holds what the others' full batches would check here (GQA causal layers, a sliding window, two head dims);
# gpt-oss's sinks run on the Hub path in the padded-batch and training-step tests, Qwen3 in the packed and compiled.
@pytest.mark.parametrize("model_name", ["gemma4"])
def test_hub_attention_gives_eager_logits_and_tokens(rand, model_name, hub_kernels, tmp_path):
    """attn_implementation="kernels-community/tpu-kernels": transformers registers its flash_attention_forward over
    the build's flash_attn_varlen_func / flash_attn_func; every layer runs our op (a full batch: flash_attn_func),
    the logits are eager's and greedy generation gives eager's tokens."""
    from transformers import modeling_flash_attention_utils as flash_utils
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import kernels

    eager, ours = _models(model_name, rand.seed, tmp_path, REPO_ID)
    assert ours.config._attn_implementation == REPO_ID
    assert ALL_ATTENTION_FUNCTIONS[REPO_ID] is flash_attention_forward
    kernel = kernels.get_kernel(REPO_ID, version=1)  # the build LOCAL_KERNELS points at, as transformers loaded it
    assert flash_utils._flash_fn is kernel.flash_attn_func
    assert flash_utils._flash_varlen_fn is kernel.flash_attn_varlen_func
    tokens = torch.from_numpy(rand.rng.integers(0, tiny_models.VOCAB, (2, 13)))
    # generate() takes a prompt holding the pad token for a padded batch (the varlen path): no pad tokens here
    pad = ours.generation_config.pad_token_id
    if pad is not None:
        tokens[tokens == pad] = (pad + 1) % tiny_models.VOCAB
    with torch.no_grad():
        expected = eager(tokens).logits
    with _counted({"flash_attention": _layers(ours)}):
        actual = ours(tokens).logits
    _assert_logits_close(actual, expected)

    # the prompt (the tokens above: their kernels are compiled), then a decode step: every further step is another
    prompt, new = tokens, 2
    with torch.no_grad():
        expected_tokens = eager.generate(prompt, max_new_tokens=new, do_sample=False, attention_mask=None)
    with _counted({"flash_attention": _layers(ours) * new}):  # the prompt, then one step per further token
        generated = ours.generate(prompt, max_new_tokens=new, do_sample=False, attention_mask=None)
    assert torch.equal(generated, expected_tokens)


def _left_padded(rand, batch, length, pads):
    tokens = torch.from_numpy(rand.rng.integers(0, tiny_models.VOCAB, (batch, length)))
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return tokens, mask


def test_hub_attention_padded_batch_through_varlen(rand, hub_kernels, tmp_path):
    """gpt-oss (sinks, a sliding window shorter than the prompt) on a left-padded batch: transformers unpads it into
    packed sequences (int32 cu_seqlens, int max_seqlen) for flash_attn_varlen_func, in the prompt and in every decode
    step; the logits of the real tokens and the greedy tokens are eager's."""
    eager, ours = _models("gpt_oss", rand.seed, tmp_path, REPO_ID)
    tokens, mask = _left_padded(rand, 2, 11, pads=(0, 4))
    with torch.no_grad():
        expected = eager(tokens, attention_mask=mask).logits
    with _counted({"flash_attention_varlen": _layers(ours)}):
        actual = ours(tokens, attention_mask=mask).logits
    real = mask.bool()
    _assert_logits_close(actual[real], expected[real])

    with torch.no_grad():
        expected_tokens = eager.generate(tokens, attention_mask=mask, max_new_tokens=2, do_sample=False)
    with _counted() as calls:  # the prompt, then a decode step with the padding still in the full layer's cache
        generated = ours.generate(tokens, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert torch.equal(generated, expected_tokens)
    # Every layer of every step on our ops; a sliding layer's cache can drop the padding out of its window, and the
    # step then needs no mask (flash_attn_func).
    assert sum(calls.values()) == _layers(ours) * 2 and calls["flash_attention_varlen"] >= _layers(ours) + 1


def _packed(rand, lengths):
    tokens = torch.from_numpy(rand.rng.integers(0, tiny_models.VOCAB, (1, sum(lengths))))
    return tokens, torch.cat([torch.arange(n) for n in lengths])[None]


def _one_by_one(model, tokens, lengths):
    """What packed sequences must give: each sequence's logits on its own. (Eager itself is no reference: it reads
    packing from position_ids only without a cache, and gpt-oss's masks never do.)"""
    with torch.no_grad():
        return torch.cat([model(part).logits for part in tokens.split(list(lengths), dim=1)], dim=1)


def test_hub_attention_packed_sequences(rand, hub_kernels, tmp_path):
    """Packed sequences in one row (position_ids restarting, as padding-free training gives them): transformers
    passes flash_attn_varlen_func int32 cu_seqlens and a 0-d tensor max_seqlen; each sequence's logits are those it
    has on its own. Then Qwen3's greedy generation on a full batch (flash_attn_func: the prompt, a decode step):
    every step's logits and the tokens are eager's."""
    eager, ours = _models("qwen3", rand.seed, tmp_path, REPO_ID)
    lengths = (5, 8, 3)
    tokens, positions = _packed(rand, lengths)
    with _counted({"flash_attention_varlen": _layers(ours)}):
        actual = ours(tokens, position_ids=positions).logits
    _assert_logits_close(actual, _one_by_one(eager, tokens, lengths))

    prompt, new = tokens.reshape(2, sum(lengths) // 2), 2
    pad = ours.generation_config.pad_token_id  # a pad token in the prompt would make it a padded batch (varlen)
    if pad is not None:
        prompt[prompt == pad] = (pad + 1) % tiny_models.VOCAB
    options = dict(max_new_tokens=new, do_sample=False, attention_mask=None, output_logits=True)
    with torch.no_grad():
        expected = eager.generate(prompt, return_dict_in_generate=True, **options)
    with _counted({"flash_attention": _layers(ours) * new}):  # the prompt, then one step per further token
        generated = ours.generate(prompt, return_dict_in_generate=True, **options)
    assert len(generated.logits) == new
    for actual_step, expected_step in zip(generated.logits, expected.logits):
        _assert_logits_close(actual_step, expected_step)
    assert torch.equal(generated.sequences, expected.sequences)


def _loss_and_grads(model, tokens):
    model.train()
    loss = model(tokens, labels=tokens).loss
    params = [p for p in model.parameters() if p.requires_grad]
    return loss, torch.autograd.grad(loss, params)


def test_training_step_gradients_match_eager(rand, hub_kernels, tmp_path):
    """One training step of tiny gpt-oss (sinks, sliding window, GQA): the loss and the gradient of every parameter
    (the sinks' through s_aux included) equal eager's."""
    eager, ours = _models("gpt_oss", rand.seed, tmp_path, REPO_ID)
    tokens = torch.from_numpy(rand.rng.integers(0, tiny_models.VOCAB, (2, 11)))
    expected_loss, expected = _loss_and_grads(eager, tokens)
    mode = _OpCalls()
    with mode:
        loss, grads = _loss_and_grads(ours, tokens)
    assert mode.calls["flash_attention"] == _layers(ours)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    names = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert any(n.endswith("sinks") for n in names)
    for name, a, e in zip(names, grads, expected):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(
            a, e, rtol=1e-4, atol=1e-4 * e.abs().max().item() + 1e-8, msg=lambda m, n=name: f"{n}: {m} ({rand})"
        )


def _compiled_graph_ops(model, tokens):
    """model(tokens).logits under torch.compile(fullgraph=True, aot_eager), and the ops its graph calls."""
    graph_ops = set()

    def recording_aot_eager(graph_module, example_inputs):
        graph_ops.update(str(n.target) for n in graph_module.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=recording_aot_eager)
    with torch.no_grad():
        return compiled(tokens, use_cache=False).logits, graph_ops


def test_hub_attention_model_compiles_fullgraph(rand, hub_kernels, tmp_path):
    """A bfloat16 Qwen3 with the Hub attention under torch.compile(fullgraph=True): our op is in the one graph and
    the logits are the uncompiled model's. (In float32 transformers' own flash wrapper breaks the graph: it logs a
    warning about casting float32 inputs.)"""
    tiny_models.qwen3(rand.seed).save_pretrained(tmp_path / "qwen3")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3", attn_implementation=REPO_ID, dtype=torch.bfloat16)
    tokens = torch.from_numpy(rand.rng.integers(0, tiny_models.VOCAB, (2, 9)))
    with torch.no_grad():
        expected = model.eval()(tokens, use_cache=False).logits
    actual, graph_ops = _compiled_graph_ops(model, tokens)
    assert any(op.endswith(".flash_attention.default") and op.startswith("_tpu_kernels_") for op in graph_ops), (
        graph_ops
    )
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.fixture(scope="module")
def direct_registration(hub_root):
    """The build's attention_forward under a name of our own, with flash attention's mask function, as README shows."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    import kernels

    kernel = kernels.get_local_kernel(hub_root / "build")
    AttentionInterface.register(DIRECT, kernel.attention_forward)
    AttentionMaskInterface.register(DIRECT, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return kernel


def test_attention_interface_registration(rand, direct_registration, tmp_path):
    """attention_forward registered under AttentionInterface (tiny gpt-oss: sinks and a window): a full batch runs
    flash_attn_func (also under torch.compile(fullgraph=True)), a left-padded batch (prompt and greedy decode
    steps) and packed sequences run flash_attn_varlen_func; all give eager's logits and tokens."""
    eager, ours = _models("gpt_oss", rand.seed, tmp_path, DIRECT)
    layers = _layers(ours)
    tokens = torch.from_numpy(rand.rng.integers(0, tiny_models.VOCAB, (2, 13)))
    with torch.no_grad():
        expected = eager(tokens).logits
    with _counted({"flash_attention": layers}):
        actual = ours(tokens).logits
    _assert_logits_close(actual, expected)
    compiled, graph_ops = _compiled_graph_ops(ours, tokens)  # float32 traces whole through attention_forward
    assert any(op.endswith(".flash_attention.default") for op in graph_ops), graph_ops
    torch.testing.assert_close(compiled, actual, rtol=0, atol=0)

    tokens, mask = _left_padded(rand, 2, 11, pads=(0, 4))  # the shapes of the Hub padded test (compiled once)
    with torch.no_grad():
        expected = eager(tokens, attention_mask=mask).logits
        expected_tokens = eager.generate(tokens, attention_mask=mask, max_new_tokens=2, do_sample=False)
    with _counted({"flash_attention_varlen": layers}):
        actual = ours(tokens, attention_mask=mask).logits
    _assert_logits_close(actual[mask.bool()], expected[mask.bool()])
    with _counted() as calls:  # decode steps: one query a row, the padding on the left
        generated = ours.generate(tokens, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert torch.equal(generated, expected_tokens) and sum(calls.values()) == layers * 2

    lengths = (11, 7)  # the padded batch's sequences: its cu_seqlens and max_seqlen, so no new kernel compiles
    tokens, positions = _packed(rand, lengths)
    with _counted({"flash_attention_varlen": layers}):
        actual = ours(tokens, position_ids=positions).logits
    _assert_logits_close(actual, _one_by_one(eager, tokens, lengths))


def test_attention_interface_under_a_static_cache(rand, direct_registration, tmp_path):
    """generate with a static cache (what a TPU compiles): for a name without "flash" transformers drops the all-ones
    padding mask, so attention_forward gets the whole cache; it attends each row's keys up to its position (tiny
    Gemma 4: the sliding layer's cache of 8 fills, 6 + 5 tokens) and gives eager's greedy tokens."""
    eager, ours = _models("gemma4", rand.seed, tmp_path, DIRECT)
    tokens = torch.from_numpy(rand.rng.integers(0, tiny_models.VOCAB, (2, 6)))
    options = dict(attention_mask=torch.ones_like(tokens), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    with torch.no_grad():
        expected = eager.generate(tokens, cache_implementation="static", **options)
    with _counted({"flash_attention_varlen": _layers(ours) * 5}):  # the prompt and 4 decode steps
        generated = ours.generate(tokens, cache_implementation="static", **options)
    assert torch.equal(generated, expected)


def test_attention_forward_refuses_what_it_cannot_serve(rand, direct_registration, tmp_path):
    """Without a mask function registered for its name transformers would pass no padding mask at all: refused,
    naming the fix. A 4-D mask (another implementation's mask function) is refused too."""
    from transformers import AttentionInterface

    AttentionInterface.register("tpu_kernels_attention_without_mask", direct_registration.attention_forward)
    model = tiny_models.qwen3(rand.seed)
    model.set_attn_implementation("tpu_kernels_attention_without_mask")
    tokens = torch.from_numpy(rand.rng.integers(0, tiny_models.VOCAB, (1, 4)))
    with pytest.raises(ValueError, match="attention_mask: no mask function is registered .*AttentionMaskInterface"):
        model(tokens)
    model.set_attn_implementation(DIRECT)
    attention = model.model.layers[0].self_attn
    query = _randn(rand, 1, 4, 4, 32)
    key = _randn(rand, 1, 2, 4, 32)
    with pytest.raises(ValueError, match=r"attention_mask: expected None or a \[batch, keys\] padding mask"):
        direct_registration.attention_forward(attention, query, key, key, torch.zeros(1, 1, 4, 4, dtype=torch.bool))
