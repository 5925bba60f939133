"""RMSNorm, torch side: the custom ops and their derived backward ops (opcheck, fake/meta shapes, torch.compile),
autograd against torch's own autograd of the formula, the inputs transformers passes (float16, views, tensors that
require grad, torch.compile of the wrapper), bad input, and the kernelize layer on transformers' own Qwen3RMSNorm."""

import ladder
import pytest
import tiny_models
import torch

import tpu_kernels
from tpu_kernels import rms_norm_ops as rms_norm_module

TORCH_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(rand, *shape, dtype=torch.float32, requires_grad=False):
    t = torch.from_numpy(rand.rng.standard_normal(shape, dtype="float32")).to(dtype)
    return t.requires_grad_(requires_grad)


def _torch_reference(x, weight, eps, weight_offset=0.0):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight_offset + weight.float())
    return y.to(x.dtype)


def _torch_fused_reference(x, residual, weight, eps, weight_offset=0.0):
    total = x + residual
    return _torch_reference(total, weight, eps, weight_offset), total


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_op_checks(rand, with_weight):
    x = _randn(rand, 6, 256, requires_grad=True)
    weight = _randn(rand, 256, requires_grad=True) if with_weight else None
    ladder.check_torch_op(rms_norm_module.rms_norm_op, (x, weight, 1e-6, 0.0), expected_shapes=[(6, 256)])


def test_fused_add_rms_norm_op_checks(rand):
    x, residual, weight = (_randn(rand, *s, requires_grad=True) for s in ((5, 128), (5, 128), (128,)))
    ladder.check_torch_op(
        rms_norm_module.fused_add_rms_norm_op, (x, residual, weight, 1e-5, 1.0), expected_shapes=[(5, 128)] * 2
    )


@pytest.mark.parametrize("wrt", ["x,weight", "weight"])
def test_derived_backward_op_checks(rand, wrt):
    """The backward op jax.vjp derives: one cotangent, the forward's arguments, the gradients asked for (the others
    come back empty: d x here; d weight empty is test_autograd_of_some_inputs_only's frozen weight, run through the
    op)."""
    g, x, weight = _randn(rand, 4, 128), _randn(rand, 4, 128), _randn(rand, 128)
    shapes = [(4, 128) if "x" in wrt.split(",") else (0,), (128,) if "weight" in wrt else (0,)]
    backward_op = rms_norm_module.rms_norm_op.backward_op
    ladder.check_torch_op(backward_op, (g, x, weight, 1e-6, 0.0, wrt), expected_shapes=shapes)


def test_derived_fused_backward_op_checks(rand):
    g_out, g_sum, x, residual, weight = (_randn(rand, *s) for s in ((3, 256),) * 4 + ((256,),))
    ladder.check_torch_op(
        rms_norm_module.fused_add_rms_norm_op.backward_op,
        (g_out, g_sum, x, residual, weight, 1e-6, 0.5, "x,residual,weight"),
        expected_shapes=[(3, 256), (3, 256), (256,)],
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_op_functions_export_for_tpu(rand, dtype):
    """What jax_op exports on a `tpu` tensor: the forward ops' and the derived backward ops' JAX functions hold the
    Mosaic kernels."""
    x, residual, weight, g = (_randn(rand, *s, dtype=dtype) for s in ((16, 256), (16, 256), (256,), (16, 256)))
    ops = rms_norm_module
    ladder.export_torch_op_for_tpu(ops.rms_norm_op, (x, weight, 1e-6, 0.0))
    ladder.export_torch_op_for_tpu(ops.rms_norm_op.backward_op, (g, x, weight, 1e-6, 0.0, "x,weight"))
    ladder.export_torch_op_for_tpu(ops.fused_add_rms_norm_op, (x, residual, weight, 1e-6, 0.0))
    ladder.export_torch_op_for_tpu(
        ops.fused_add_rms_norm_op.backward_op, (g, g, x, residual, weight, 1e-6, 0.0, "x,residual,weight")
    )


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_rms_norm_matches_reference(rand, dtype):
    x, weight = _randn(rand, 3, 7, 320, dtype=dtype), _randn(rand, 320, dtype=dtype)
    out = tpu_kernels.rms_norm(x, weight, 1e-6, weight_offset=1.0)
    assert out.dtype == dtype and out.shape == x.shape
    ladder.assert_close(
        out.float().numpy(),
        _torch_reference(x, weight, 1e-6, 1.0).float().numpy(),
        dtype=ladder.jnp.dtype(str(dtype).removeprefix("torch.")),
        context=repr(rand),
    )


@pytest.mark.parametrize("dtype", [torch.float16], ids=str)
def test_fused_autograd_matches_torch_reference(rand, dtype):
    """d x, d residual, d weight of the fused op (its backward op is jax.vjp of the fused forward) in float16 (run as
    float32: gradients come back in float16), the wrapper's one dtype-dependent step; the float32 gradients' accuracy
    is the JAX side's (test_rms_norm.py), float32 autograd through the torch op test_autograd_of_some_inputs_only's."""
    inputs = {
        "x": _randn(rand, 9, 256, dtype=dtype, requires_grad=True),
        "residual": _randn(rand, 9, 256, dtype=dtype, requires_grad=True),
        "weight": _randn(rand, 256, dtype=dtype, requires_grad=True),
        "eps": 1e-6,
    }
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    ladder.check_torch_gradients(
        tpu_kernels.fused_add_rms_norm, _torch_fused_reference, inputs, rand=rand, rtol=tol, atol=tol
    )


def test_autograd_of_some_inputs_only(rand):
    """Only x requires grad (a frozen norm weight): the backward op is asked for d x alone; no weight: the same."""
    for weight in (_randn(rand, 256), None):
        inputs = {"x": _randn(rand, 5, 256, requires_grad=True), "weight": weight, "eps": 1e-6}
        grads = ladder.check_torch_gradients(
            tpu_kernels.rms_norm, _torch_reference, inputs, rand=rand, rtol=1e-4, atol=1e-4
        )
        assert list(grads) == ["x"]


def test_views_and_tensors_that_require_grad(rand):
    """Non-contiguous views (a transposed activation, a strided weight) are read as their values, not their buffers;
    the gradients land on the views' bases."""
    base = _randn(rand, 256, 6, requires_grad=True)
    weight_base = _randn(rand, 512, requires_grad=True)
    inputs = {"base": base, "weight_base": weight_base}

    def ours(base, weight_base):
        return tpu_kernels.rms_norm(base.t(), weight_base[::2], 1e-6)

    def reference(base, weight_base):
        return _torch_reference(base.t(), weight_base[::2], 1e-6)

    assert not base.t().is_contiguous() and not weight_base[::2].is_contiguous()
    ladder.check_torch_gradients(ours, reference, inputs, rand=rand, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_wrapper_compiles_fullgraph_with_autograd(rand, fused):
    inputs = {"x": _randn(rand, 4, 128, requires_grad=True), "weight": _randn(rand, 128, requires_grad=True)}
    if fused:
        inputs["residual"] = _randn(rand, 4, 128, requires_grad=True)

    def fn(x, weight, residual=None):
        if residual is None:
            return tpu_kernels.rms_norm(x, weight, 1e-6, weight_offset=0.5)
        return tpu_kernels.fused_add_rms_norm(x, residual, weight, 1e-6)

    ladder.check_compiled_matches_eager(fn, inputs, rand=rand)


# ------------------------------------------------------------------------------------------------------ bad input
def _good(rand):
    return {"x": _randn(rand, 4, 128), "weight": _randn(rand, 128), "eps": 1e-6}


BAD_INPUTS = [
    ladder.BadInput("x not a tensor", {"x": [[1.0]]}, TypeError, "x: expected a torch.Tensor, got list"),
    ladder.BadInput(
        "weight on another device",
        {"weight": torch.empty(128, device="meta")},
        ValueError,
        "weight: expected a tensor on cpu",
    ),
    ladder.BadInput(
        "complex x",
        lambda rand: {"x": _randn(rand, 4, 128).to(torch.complex64)},
        TypeError,
        "x: dtype torch.complex64 is not supported",
    ),
    ladder.BadInput("float64 x", lambda rand: {"x": _randn(rand, 4, 128).double()}, TypeError, "got float64"),
    ladder.BadInput(
        "weight size", lambda rand: {"weight": _randn(rand, 64)}, ValueError, "weight: expected shape (128,)"
    ),
    ladder.BadInput("negative eps", {"eps": -0.1}, ValueError, "eps: expected a finite number >= 0, got -0.1"),
    ladder.BadInput("eps a tensor", {"eps": torch.tensor(1e-6)}, TypeError, "eps: expected a Python float"),
    ladder.BadInput(
        "residual shape",
        lambda rand: {"residual": _randn(rand, 2, 128)},
        ValueError,
        "residual: expected the shape of x",
    ),
    ladder.BadInput(
        "residual dtype",
        lambda rand: {"residual": _randn(rand, 4, 128, dtype=torch.bfloat16)},
        TypeError,
        "residual: expected dtype",
    ),
    # Meta tensors take the same checks: a wrong shape is refused before any shape inference.
    ladder.BadInput(
        "meta weight size",
        {"x": torch.empty(4, 128, device="meta"), "weight": torch.empty(3, device="meta")},
        ValueError,
        "weight: expected shape (128,)",
    ),
]


def _call(arguments):
    if "residual" in arguments:
        return tpu_kernels.fused_add_rms_norm(**arguments)
    return tpu_kernels.rms_norm(**arguments)


@ladder.bad_input_params(BAD_INPUTS)
def test_torch_bad_input(rand, case):
    ladder.assert_clear_error(case, _call, _good(rand), rand)


# ------------------------------------------------------------------------------------------- kernelize a model
def test_layer_passes_kernels_layer_validation():
    from kernels.layer.layer import _validate_layer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    _validate_layer(check_cls=Qwen3RMSNorm, cls=tpu_kernels.layers.RMSNorm, repo="tpu-kernels")


def test_kernelized_qwen3_gives_the_same_logits(rand, hub_root):
    """transformers' own Qwen3RMSNorm, as its `@use_kernel_forward_from_hub("RMSNorm")` decorator leaves it (with
    transformers 5.22.2 and kernels 0.17.2 the decorator acts), is replaced by our layer from the Hub build."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    assert Qwen3RMSNorm.kernel_layer_name == "RMSNorm", "transformers' decorator did not mark Qwen3RMSNorm"
    model = tiny_models.qwen3(rand.seed)
    tokens = torch.from_numpy(rand.rng.integers(0, tiny_models.VOCAB, (2, 11)))
    with torch.no_grad():
        expected = model(tokens).logits

    mapping = {"RMSNorm": {"cpu": LocalLayerRepository(hub_root / "build", layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        model = kernelize(model, mode=Mode.INFERENCE, device="cpu")
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert norms and all(m.forward.__func__.__module__.endswith("layers") for m in norms), "RMSNorm not replaced"
    with torch.no_grad():
        actual = model(tokens).logits
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
