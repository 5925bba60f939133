"""Rotary embeddings, torch side: the custom ops and their derived backward ops (opcheck, fake/meta shapes,
torch.compile), autograd against torch's own autograd of the formula, the inputs transformers passes (int64
position_ids, float16, transposed q/k views, tensors that require grad, torch.compile of the wrappers), bad input, the
inverse frequencies against transformers' rope init functions, and the `rotary_pos_emb` kernelize layer on
transformers' own Qwen3 attention."""

import json

import ladder
import numpy as np
import pytest
import torch

import tpu_kernels
from tpu_kernels import _op_registry, rotary_ops
from tpu_kernels_jax.rotary import frequencies


def _randn(rand, *shape, dtype=torch.float32, requires_grad=False):
    t = torch.from_numpy(rand.rng.standard_normal(shape, dtype="float32")).to(dtype)
    return t.requires_grad_(requires_grad)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _torch_rope(x, cos, sin, head_axis=1):
    """transformers' formula (first r features rotate), in f32."""
    r = cos.shape[-1]
    c, s = cos.float().unsqueeze(head_axis), sin.float().unsqueeze(head_axis)
    xf = x.float()
    return torch.cat((xf[..., :r] * c + _rotate_half(xf[..., :r]) * s, xf[..., r:]), dim=-1).to(x.dtype)


def _torch_norm(x, w, eps, weight_offset):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight_offset + w.float())


# The op checks take the shapes, layout and static arguments of the wrappers' transformers-inputs test (q [1, 2, 8,
# 128], k [1, 1, 8, 128] bhsd, every float input requiring grad): the same forward and backward programs, compiled
# once for both. Grouped-query heads, shared tables and every gradient output are what the op path carries; the
# per-batch tables, bshd, interleaved and empty-gradient outputs are in the derived backward and positions op checks.
def test_apply_rotary_op_checks(rand):
    q, k = _randn(rand, 1, 2, 8, 128, requires_grad=True), _randn(rand, 1, 1, 8, 128, requires_grad=True)
    cos, sin = _randn(rand, 1, 8, 128, requires_grad=True), _randn(rand, 1, 8, 128, requires_grad=True)
    ladder.check_torch_op(
        rotary_ops.apply_rotary_op, (q, k, cos, sin, False, "bhsd"), expected_shapes=[(1, 2, 8, 128), (1, 1, 8, 128)]
    )


@pytest.mark.parametrize("wrt", ["q,k,cos,sin", "q,k"])
def test_derived_backward_op_checks(rand, wrt):
    """The backward op jax.vjp derives: the cotangents of q and k, the forward's arguments, the gradients asked for
    (transformers' cos/sin do not require grad: their gradients are then not computed, and come back empty)."""
    gq, gk, q, k = (
        _randn(rand, 2, 8, 4, 128),
        _randn(rand, 2, 8, 1, 128),
        _randn(rand, 2, 8, 4, 128),
        _randn(rand, 2, 8, 1, 128),
    )
    cos, sin = _randn(rand, 2, 8, 64), _randn(rand, 2, 8, 64)
    tables = [(2, 8, 64)] * 2 if "cos" in wrt else [(0,)] * 2
    ladder.check_torch_op(
        rotary_ops.apply_rotary_op.backward_op,
        (gq, gk, q, k, cos, sin, True, "bshd", wrt),
        expected_shapes=[(2, 8, 4, 128), (2, 8, 1, 128), *tables],
    )


def test_rms_norm_rope_op_checks(rand):
    q, k = _randn(rand, 1, 2, 8, 128, requires_grad=True), _randn(rand, 1, 1, 8, 128, requires_grad=True)
    qw, kw = _randn(rand, 128, requires_grad=True), _randn(rand, 128, requires_grad=True)
    cos, sin = _randn(rand, 1, 8, 128, requires_grad=True), _randn(rand, 1, 8, 128, requires_grad=True)
    ladder.check_torch_op(
        rotary_ops.rms_norm_rope_op,
        (q, k, qw, kw, cos, sin, 1e-6, 0.0, False, "bhsd"),
        expected_shapes=[(1, 2, 8, 128), (1, 1, 8, 128)],
    )


# float16 (run as float32, one float16 rounding of the float32 result) through every wrapper:
# test_every_rotary_wrapper_takes_transformers_inputs.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_apply_rotary_matches_reference(rand, dtype):
    q, k = _randn(rand, 2, 5, 3, 128, dtype=dtype), _randn(rand, 2, 5, 1, 128, dtype=dtype)
    cos, sin = _randn(rand, 2, 5, 64, dtype=dtype), _randn(rand, 2, 5, 64, dtype=dtype)  # partial rotary
    out_q, out_k = tpu_kernels.apply_rotary(q, k, cos, sin, layout="bshd")
    assert out_q.dtype == dtype and out_k.dtype == dtype and out_q.shape == q.shape and out_k.shape == k.shape
    jdtype = ladder.jnp.dtype(str(dtype).removeprefix("torch."))
    for out, x in ((out_q, q), (out_k, k)):
        ladder.assert_close(
            out.float().numpy(), _torch_rope(x, cos, sin, head_axis=2).float().numpy(), dtype=jdtype, context=repr(rand)
        )


def _norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps, weight_offset):
    return tuple(
        _torch_rope(_torch_norm(x, w, eps, weight_offset), cos, sin) for x, w in ((q, q_weight), (k, k_weight))
    )


@pytest.mark.parametrize(
    ("tables_require_grad", "batch", "seq", "weight_offset"), [(True, 1, 8, 0.0), (False, 2, 6, 0.5)], ids=str
)
def test_torch_autograd_matches_torch_reference(rand, tables_require_grad, batch, seq, weight_offset):
    """The fused norm + rope: d q, d k, d weights and (when asked) d cos, d sin, all from the JAX api's vjp. With the
    tables' gradients: the op checks' shapes and arguments (their programs); without: a batch of 2, 6 tokens (less
    than a block) and a weight offset."""
    shapes = dict(q=(batch, 2, seq, 128), k=(batch, 1, seq, 128), q_weight=(128,), k_weight=(128,), cos=(1, seq, 128))
    shapes["sin"] = shapes["cos"]
    inputs = {name: _randn(rand, *shape, requires_grad=True) for name, shape in shapes.items()}
    inputs["cos"].requires_grad_(tables_require_grad)
    inputs["sin"].requires_grad_(tables_require_grad)
    inputs.update(eps=1e-6, weight_offset=weight_offset)
    grads = ladder.check_torch_gradients(
        tpu_kernels.rms_norm_rope, _norm_rope_reference, inputs, rand=rand, rtol=1e-4, atol=2e-4
    )
    assert ("cos" in grads) == tables_require_grad


def test_transposed_views_as_transformers_passes_them(rand):
    """transformers builds q/k as projections viewed [B, S, H, D] and transposed to [B, H, S, D] (not contiguous):
    the values are rotated, and the gradients land on the projections."""
    inputs = {
        "q_proj": _randn(rand, 2, 6, 4, 128, requires_grad=True),
        "k_proj": _randn(rand, 2, 6, 2, 128, requires_grad=True),
        "cos": _randn(rand, 2, 6, 128),
        "sin": _randn(rand, 2, 6, 128),
    }

    def ours(q_proj, k_proj, cos, sin):
        return tpu_kernels.apply_rotary(q_proj.transpose(1, 2), k_proj.transpose(1, 2), cos, sin)

    def reference(q_proj, k_proj, cos, sin):
        return _torch_rope(q_proj.transpose(1, 2), cos, sin), _torch_rope(k_proj.transpose(1, 2), cos, sin)

    assert not inputs["q_proj"].transpose(1, 2).is_contiguous()
    ladder.check_torch_gradients(ours, reference, inputs, rand=rand, rtol=1e-5, atol=1e-5)


def _table_inputs(rand):
    return {
        "q": _randn(rand, 2, 4, 8, 128),
        "k": _randn(rand, 2, 2, 8, 128),
        "cos": _randn(rand, 1, 8, 128),
        "sin": _randn(rand, 1, 8, 128),
    }


BAD_TABLE_INPUTS = [
    ladder.BadInput("q not a tensor", {"q": [[1.0]]}, TypeError, "q: expected a torch.Tensor, got list"),
    ladder.BadInput(
        "cos on another device",
        lambda rand: {"cos": torch.empty(1, 8, 128, device="meta")},
        ValueError,
        "cos: expected a tensor on cpu",
    ),
    ladder.BadInput(
        "float64 q", lambda rand: {"q": _randn(rand, 2, 4, 8, 128).double()}, TypeError, "q: expected dtype"
    ),
    ladder.BadInput(
        "k dtype",
        lambda rand: {"k": _randn(rand, 2, 2, 8, 128, dtype=torch.bfloat16)},
        TypeError,
        "k: expected dtype",
    ),
    ladder.BadInput(
        "odd rotary dim",
        lambda rand: {"cos": _randn(rand, 1, 8, 63), "sin": _randn(rand, 1, 8, 63)},
        ValueError,
        "rotary_dim (cos.shape[-1]): expected an even number",
    ),
    ladder.BadInput(
        "rotary dim above head_dim",
        lambda rand: {"cos": _randn(rand, 1, 8, 256), "sin": _randn(rand, 1, 8, 256)},
        ValueError,
        "rotary_dim (cos.shape[-1]): expected at most head_dim = 128",
    ),
    ladder.BadInput("sin shape", lambda rand: {"sin": _randn(rand, 1, 7, 128)}, ValueError, "sin: expected the shape"),
    ladder.BadInput("layout", {"layout": "bsd"}, ValueError, "layout: expected 'bhsd' or 'bshd'"),
    ladder.BadInput("interleaved not a bool", {"interleaved": "yes"}, TypeError, "interleaved: expected a bool"),
    ladder.BadInput(
        "k_weight size",
        lambda rand: {"q_weight": _randn(rand, 128), "k_weight": _randn(rand, 64)},
        ValueError,
        "k_weight: expected shape (128,)",
    ),
    ladder.BadInput(
        "negative eps",
        lambda rand: {"q_weight": _randn(rand, 128), "k_weight": _randn(rand, 128), "eps": -1.0},
        ValueError,
        "eps: expected a finite number >= 0",
    ),
    # Meta tensors take the same checks.
    ladder.BadInput(
        "meta k seq",
        {
            "q": torch.empty(2, 4, 8, 128, device="meta"),
            "k": torch.empty(2, 2, 9, 128, device="meta"),
            "cos": torch.empty(1, 8, 128, device="meta"),
            "sin": torch.empty(1, 8, 128, device="meta"),
        },
        ValueError,
        "k: expected the batch, seq and head_dim of q",
    ),
]


def _call_tables(arguments):
    if "q_weight" in arguments:
        return tpu_kernels.rms_norm_rope(**arguments)
    return tpu_kernels.apply_rotary(**arguments)


@ladder.bad_input_params(BAD_TABLE_INPUTS)
def test_torch_bad_input(rand, case):
    ladder.assert_clear_error(case, _call_tables, _table_inputs(rand), rand)


# ------------------------------------------------------------------------------------------ cos/sin from positions
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 16}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _positions(rand, *shape, high=40000, dtype=torch.int32):
    return torch.from_numpy(rand.rng.integers(0, high, shape)).to(dtype)


def _rope(theta, rotary_dim=None, scaling=None):
    return _op_registry.static_json("rope", {"theta": theta, "rotary_dim": rotary_dim, "scaling": scaling})


def test_apply_rotary_from_positions_op_checks(rand):
    q, k = _randn(rand, 1, 2, 8, 128, requires_grad=True), _randn(rand, 1, 1, 8, 128, requires_grad=True)
    ladder.check_torch_op(
        rotary_ops.apply_rotary_from_positions_op,
        (q, k, _positions(rand, 1, 8), _rope(1e6, None, YARN), False, "bhsd"),
        expected_shapes=[(1, 2, 8, 128), (1, 1, 8, 128)],
    )


def test_rms_norm_rope_from_positions_op_checks(rand):
    q, k = _randn(rand, 1, 8, 2, 128, requires_grad=True), _randn(rand, 1, 8, 1, 128, requires_grad=True)
    qw, kw = _randn(rand, 128, requires_grad=True), _randn(rand, 128)
    args = (q, k, qw, kw, _positions(rand, 1, 8), _rope(1e4, 64), 1e-6, 0.0, True, "bshd")
    ladder.check_torch_op(
        rotary_ops.rms_norm_rope_from_positions_op, args, expected_shapes=[(1, 8, 2, 128), (1, 8, 1, 128)]
    )


def test_op_functions_export_for_tpu(rand):
    """What jax_op exports on a `tpu` tensor: forward and derived backward JAX functions hold the Mosaic kernels
    (tables with float16 q/k; positions with the rope JSON)."""
    q, k = _randn(rand, 2, 4, 16, 128, dtype=torch.float16), _randn(rand, 2, 2, 16, 128, dtype=torch.float16)
    cos, sin = _randn(rand, 1, 16, 128), _randn(rand, 1, 16, 128)
    ladder.export_torch_op_for_tpu(rotary_ops.apply_rotary_op, (q, k, cos, sin, False, "bhsd"))
    backward = rotary_ops.apply_rotary_op.backward_op
    ladder.export_torch_op_for_tpu(backward, (q, k, q, k, cos, sin, False, "bhsd", "q,k,cos,sin"))
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    w = _randn(rand, 128, dtype=torch.bfloat16)
    args = (q, k, w, w, _positions(rand, 2, 16), _rope(1e6, None, YARN), 1e-6, 0.0, False, "bhsd")
    ladder.export_torch_op_for_tpu(rotary_ops.rms_norm_rope_from_positions_op, args)
    backward = rotary_ops.rms_norm_rope_from_positions_op.backward_op
    ladder.export_torch_op_for_tpu(backward, (q, k, *args, "q,k,q_weight,k_weight"))


ROPE_PARAMETERS = [
    None,
    YARN,
    LLAMA3,
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "proportional", "partial_rotary_factor": 0.25},
    {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "truncate": False,
        "attention_factor": None,
    },
]


def _rotary_call(name):
    """One of the four rotary wrappers over projections [B, S, H, D] seen as [B, H, S, D] (transposed views, as
    transformers passes q/k), with whatever tables, weights or positions it takes."""

    def call(q_proj, k_proj, extra):
        q, k = q_proj.transpose(1, 2), k_proj.transpose(1, 2)
        if name == "apply_rotary":
            return tpu_kernels.apply_rotary(q, k, extra["cos"], extra["sin"])
        if name == "rms_norm_rope":
            return tpu_kernels.rms_norm_rope(q, k, extra["q_weight"], extra["k_weight"], extra["cos"], extra["sin"])
        if name == "apply_rotary_from_positions":
            return tpu_kernels.apply_rotary_from_positions(q, k, extra["positions"], theta=1e6, scaling=YARN)
        return tpu_kernels.rms_norm_rope_from_positions(
            q, k, extra["q_weight"], extra["k_weight"], extra["positions"], theta=1e6, scaling=YARN
        )

    return call


ROTARY_WRAPPERS = ["apply_rotary", "rms_norm_rope", "apply_rotary_from_positions", "rms_norm_rope_from_positions"]
# The float inputs besides q/k each wrapper differentiates.
DIFFERENTIABLE_EXTRAS = {
    "apply_rotary": ("cos", "sin"),
    "rms_norm_rope": ("q_weight", "k_weight", "cos", "sin"),
    "apply_rotary_from_positions": (),
    "rms_norm_rope_from_positions": ("q_weight", "k_weight"),
}


def _rotary_inputs(rand, dtype=torch.float32):
    extra = {
        "cos": _randn(rand, 1, 8, 128, dtype=dtype),
        "sin": _randn(rand, 1, 8, 128, dtype=dtype),
        "q_weight": _randn(rand, 128, dtype=dtype),
        "k_weight": _randn(rand, 128, dtype=dtype),
        "positions": _positions(rand, 1, 8, dtype=torch.int64),  # transformers' position_ids
    }
    q_proj = _randn(rand, 1, 8, 2, 128, dtype=dtype, requires_grad=True)
    return q_proj, _randn(rand, 1, 8, 1, 128, dtype=dtype, requires_grad=True), extra


@pytest.mark.parametrize("name", ROTARY_WRAPPERS)
def test_every_rotary_wrapper_takes_transformers_inputs(rand, name):
    """Each rotary op on what transformers passes: transposed q/k views, int64 positions, q/k that require grad, float16
    (run as float32: one float16 rounding from the float32 result), and the wrapper under torch.compile(fullgraph=True)
    with autograd of q/k and of the tables and weights it takes (the checks, the int64 -> int32 cast and the rope
    JSON trace without a graph break). The gradients of the projections are those of the compiled check (eager
    against compiled, NaN failing); their values against torch's autograd of the formula are in the autograd tests."""
    call = _rotary_call(name)
    q_proj, k_proj, extra = _rotary_inputs(rand)
    out_q, out_k = call(q_proj, k_proj, extra)
    dense = call(q_proj.detach().contiguous(), k_proj.detach().contiguous(), extra)
    for out, expected in zip((out_q, out_k), dense):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)

    # float16 against float32 on the same (float16-rounded) inputs: one float16 rounding of the result apart, half an
    # ulp (2^-11 relative; 2^-25 absolute below float16's normals). Against the unrounded inputs' result the inputs'
    # rounding would count too, which RoPE's x1 cos - x2 sin amplifies wherever the two terms nearly cancel.
    half = {key: value.half() if value.is_floating_point() else value for key, value in extra.items()}
    half_q, half_k = call(q_proj.detach().half(), k_proj.detach().half(), half)
    rounded = {key: value.float() if value.is_floating_point() else value for key, value in half.items()}
    exact = call(q_proj.detach().half().float(), k_proj.detach().half().float(), rounded)
    for out, expected in zip((half_q, half_k), exact):
        assert out.dtype == torch.float16
        ladder.assert_close(out.float().numpy(), expected.detach().numpy(), rtol=2**-11, atol=2**-25)

    # Under compile the wrapper's tables and norm weights require grad too: their gradients come back through the
    # compiled graph as eager's.
    compiled = {"q_proj": q_proj, "k_proj": k_proj}
    compiled |= {key: extra[key].clone().requires_grad_() for key in DIFFERENTIABLE_EXTRAS[name]}
    ladder.check_compiled_matches_eager(
        lambda q_proj, k_proj, **grads: call(q_proj, k_proj, extra | grads), compiled, rand=rand
    )


def test_rope_parameters_cross_as_canonical_json():
    """The rope parameters reach the JAX function as they were given, as one string that is the same for equal dicts
    (one jit / export cache entry, one compile guard) whatever their key order."""
    for scaling in ROPE_PARAMETERS:
        text = _rope(5e5, 64, scaling)
        assert json.loads(text) == {"theta": 5e5, "rotary_dim": 64, "scaling": scaling}
        shuffled = None if scaling is None else dict(reversed(list(scaling.items())))
        assert _rope(5e5, 64, shuffled) == text
    assert _rope(5e5) != _rope(5e5 + 1e-9)
    with pytest.raises(TypeError, match="rope: expected dicts, lists, str, int, float, bool or None"):
        _rope(5e5, scaling={"rope_type": "linear", "factor": np.float32(2.0)})
    with pytest.raises(ValueError, match="rope: .* does not survive JSON"):
        _rope(float("inf"))


def _from_positions_reference(q, k, q_weight, k_weight, positions, *, cos, sin):
    return _norm_rope_reference(q, k, q_weight, k_weight, cos, sin, 1e-6, 0.5)


@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64], ids=str)
def test_torch_from_positions_matches_torch_reference_with_autograd(rand, positions_dtype):
    """rms_norm_rope_from_positions (llama3 scaling; int32 positions, or int64 as transformers' position_ids are):
    outputs and d q, d k, d weights against torch's autograd of the formula on transformers-style tables;
    apply_rotary_from_positions with k=None against the same tables."""
    shapes = dict(q=(2, 3, 6, 128), k=(2, 1, 6, 128), q_weight=(128,), k_weight=(128,))
    inputs = {name: _randn(rand, *shape, requires_grad=True) for name, shape in shapes.items()}
    inputs["positions"] = _positions(rand, 2, 6, high=20000, dtype=positions_dtype)
    cos, sin = (
        torch.from_numpy(np.array(t))
        for t in rotary_ops.api.rope_cos_sin(inputs["positions"].int().numpy(), head_dim=128, theta=5e5, scaling=LLAMA3)
    )

    def ours(q, k, q_weight, k_weight, positions):
        return tpu_kernels.rms_norm_rope_from_positions(
            q, k, q_weight, k_weight, positions, theta=5e5, eps=1e-6, weight_offset=0.5, scaling=LLAMA3
        )

    def reference(**a):
        return _from_positions_reference(**a, cos=cos, sin=sin)

    ladder.check_torch_gradients(ours, reference, inputs, rand=rand, rtol=1e-4, atol=2e-4)

    q = _randn(rand, 2, 6, 3, 128, dtype=torch.bfloat16)
    out, none = tpu_kernels.apply_rotary_from_positions(
        q, None, inputs["positions"], theta=5e5, scaling=LLAMA3, layout="bshd"
    )
    assert none is None and out.dtype == torch.bfloat16
    ladder.assert_close(
        out.float().numpy(),
        _torch_rope(q, cos, sin, head_axis=2).float().numpy(),
        dtype=ladder.jnp.dtype("bfloat16"),
        context=repr(rand),
    )


def test_from_positions_in_float16(rand):
    """float16 q/k run as float32 and come back float16, as close to the f32 result as one float16 rounding."""
    q, k = _randn(rand, 1, 2, 8, 128), _randn(rand, 1, 1, 8, 128)
    positions = _positions(rand, 1, 8, dtype=torch.int64)
    exact = tpu_kernels.apply_rotary_from_positions(q, k, positions, theta=1e6, scaling=YARN)
    half = tpu_kernels.apply_rotary_from_positions(q.half(), k.half(), positions, theta=1e6, scaling=YARN)
    for out, ref in zip(half, exact):
        assert out.dtype == torch.float16
        ladder.assert_close(out.float().numpy(), ref.numpy(), dtype=ladder.jnp.float16, context=repr(rand))


def _position_inputs(rand):
    return {
        "q": _randn(rand, 2, 4, 8, 128),
        "k": _randn(rand, 2, 2, 8, 128),
        "positions": _positions(rand, 2, 8),
        "theta": 1e4,
    }


def _int64_positions(value):
    positions = torch.zeros(2, 8, dtype=torch.int64)
    positions[1, 3] = value
    return {"positions": positions}


BAD_POSITION_INPUTS = [
    ladder.BadInput(
        "position past float32's exact range",
        {"positions": torch.full((2, 8), 1 << 24, dtype=torch.int32)},
        ValueError,
        "positions: expected values in [0, 16777216)",
    ),
    ladder.BadInput(
        "int64 position past float32's exact range",
        _int64_positions(1 << 24),
        ValueError,
        "positions: expected values in [0, 16777216)",
    ),
    ladder.BadInput("negative int64 position", _int64_positions(-3), ValueError, "got values in [-3, 0]"),
    ladder.BadInput(
        "int64 position int32 cannot hold",
        _int64_positions(1 << 32),
        ValueError,
        "positions: expected int64 values that int32 can hold",
    ),
    ladder.BadInput("float positions", {"positions": torch.zeros(2, 8)}, TypeError, "positions: expected dtype"),
    ladder.BadInput(
        "positions shape", {"positions": torch.zeros(2, 7, dtype=torch.int32)}, ValueError, "positions: expected shape"
    ),
    ladder.BadInput(
        "llama3 without its factors",
        {"scaling": {"rope_type": "llama3", "factor": 8.0}},
        ValueError,
        "scaling: rope_type 'llama3' needs",
    ),
    ladder.BadInput("theta", {"theta": 1.0}, ValueError, "theta: expected a rope base > 1"),
    ladder.BadInput(
        "scaling value JSON cannot carry",
        {"scaling": {"rope_type": "linear", "factor": float("nan")}},
        ValueError,
        "factor",
    ),
    ladder.BadInput(
        "k_weight size",
        lambda rand: {"q_weight": _randn(rand, 128), "k_weight": _randn(rand, 64)},
        ValueError,
        "k_weight: expected shape (128,)",
    ),
]


def _call_positions(arguments):
    if "q_weight" in arguments:
        return tpu_kernels.rms_norm_rope_from_positions(**arguments)
    return tpu_kernels.apply_rotary_from_positions(**arguments)


@ladder.bad_input_params(BAD_POSITION_INPUTS)
def test_torch_from_positions_bad_input(rand, case):
    ladder.assert_clear_error(case, _call_positions, _position_inputs(rand), rand)


# ------------------------------------------------------------------------------- frequencies vs transformers
def _rope_config(rope_parameters, head_dim=128, partial_rotary_factor=None):
    from transformers import LlamaConfig

    params = {"rope_theta": 5e5, **rope_parameters}
    if partial_rotary_factor is not None:
        params["partial_rotary_factor"] = partial_rotary_factor
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_parameters=params,
        max_position_embeddings=131072,
    )


TRANSFORMERS_ROPES = [
    ("linear", {"rope_type": "linear", "factor": 4.0}, None),
    (
        "llama3",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        None,
    ),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, None),
    (
        "yarn-mscale",
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
            "beta_slow": 2,
        },
        None,
    ),
    ("yarn-partial", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}, 0.5),
    ("proportional", {"rope_type": "proportional"}, 0.25),
]


@pytest.mark.parametrize("case", TRANSFORMERS_ROPES, ids=[c[0] for c in TRANSFORMERS_ROPES])
def test_inverse_frequencies_match_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, params, partial = case
    config = _rope_config(params, partial_rotary_factor=partial)
    expected, expected_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    scaling = dict(params, **({"partial_rotary_factor": partial} if params["rope_type"] == "proportional" else {}))
    rotary_dim = int(128 * (partial or 1.0)) if params["rope_type"] != "proportional" else 128
    inv, attention_scaling, r = frequencies.inverse_frequencies(128, 5e5, rotary_dim, scaling)
    np.testing.assert_allclose(inv, expected.numpy(), rtol=2e-6, atol=0)
    assert attention_scaling == pytest.approx(expected_scaling, rel=1e-12)
    assert r == 2 * len(inv)


# ------------------------------------------------------------------------------------------- kernelize a model
def test_layer_passes_kernels_layer_validation():
    from kernels.layer.layer import _validate_layer
    from transformers.models.qwen3 import modeling_qwen3

    hub_function = modeling_qwen3.apply_rotary_pos_emb  # a hub function module, as transformers' decorator made it
    assert hub_function.kernel_layer_name == "rotary_pos_emb"
    _validate_layer(check_cls=type(hub_function), cls=tpu_kernels.layers.RotaryPosEmb, repo="tpu-kernels")
    assert tpu_kernels.layers.apply_rotary_transformers is tpu_kernels.layers.RotaryPosEmb


def _tiny_qwen3(seed):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=211,
        hidden_size=256,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def test_kernelized_qwen3_gives_the_same_logits(rand, hub_root):
    """transformers' own `rotary_pos_emb` hub function (Qwen3Attention calls it through `use_kernelized_func`), as
    its decorators leave it with transformers 5.22.2 and kernels 0.17.2, is replaced by our layer from the Hub build."""
    from transformers.models.qwen3 import modeling_qwen3

    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    hub_function = modeling_qwen3.apply_rotary_pos_emb
    model = _tiny_qwen3(rand.seed)
    tokens = torch.from_numpy(rand.rng.integers(0, 211, (2, 11)))
    with torch.no_grad():
        expected = model(tokens).logits

    mapping = {"rotary_pos_emb": {"cpu": LocalLayerRepository(hub_root / "build", layer_name="RotaryPosEmb")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        model = kernelize(model, mode=Mode.INFERENCE, device="cpu")
    assert hub_function.forward.__func__.__module__.endswith("layers"), "rotary_pos_emb not replaced"
    with torch.no_grad():
        actual = model(tokens).logits
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_gemma4_with_the_rotary_kernel_gives_the_same_logits(rand, monkeypatch):
    """Gemma 4's text attention rotates q and k separately through its own single-tensor apply_rotary_pos_emb(x, cos,
    sin, unsqueeze_dim=2), which has no hub hook in transformers 5.23 (so no kernelize); swap it for the kernel (k=None,
    bshd) and compare logits. Covers Gemma 4's "proportional" partial rotary (full-attention layer, head_dim 256,
    a quarter of the frequencies non-zero) through transformers' own tables, and its sliding layers."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4 import modeling_gemma4

    config = Gemma4TextConfig(
        vocab_size=211,
        hidden_size=128,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        global_head_dim=256,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        vocab_size_per_layer_input=211,
        hidden_size_per_layer_input=16,
        max_position_embeddings=64,
    )
    torch.manual_seed(rand.seed)
    model = modeling_gemma4.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "Gemma4RMSNorm" and getattr(module, "with_scale", False):
                module.weight.normal_(1.0, 0.3)
    tokens = torch.from_numpy(rand.rng.integers(0, 211, (2, 11)))
    with torch.no_grad():
        expected = model(tokens).logits

    seen = []

    def kernel_rotary(x, cos, sin, unsqueeze_dim=1):
        seen.append(x.shape[-1])
        out, _ = tpu_kernels.apply_rotary(x, None, cos, sin, layout="bshd" if unsqueeze_dim == 2 else "bhsd")
        return out

    monkeypatch.setattr(modeling_gemma4, "apply_rotary_pos_emb", kernel_rotary)
    with torch.no_grad():
        actual = model(tokens).logits
    assert sorted(set(seen)) == [128, 256], seen  # both layer kinds went through the kernel
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
