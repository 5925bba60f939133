"""RMSNorm, torch side: the custom ops (opcheck, fake/meta shapes, torch.compile), autograd against torch's own
autograd of the formula, torch-only bad input, and the kernelize layer in a tiny random Qwen3 model."""

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


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_op_checks(rand, with_weight):
    x = _randn(rand, 6, 256)
    weight = _randn(rand, 256) if with_weight else None
    ladder.check_torch_op(rms_norm_module.rms_norm_op, (x, weight, 1e-6, 0.0), expected_shapes=[(6, 256)])


def test_fused_add_rms_norm_op_checks(rand):
    x, residual, weight = _randn(rand, 5, 128), _randn(rand, 5, 128), _randn(rand, 128)
    ladder.check_torch_op(
        rms_norm_module.fused_add_rms_norm_op, (x, residual, weight, 1e-5, 1.0), expected_shapes=[(5, 128)] * 2
    )


def test_backward_op_checks(rand):
    g, x, weight, gsum = _randn(rand, 4, 128), _randn(rand, 4, 128), _randn(rand, 128), _randn(rand, 4, 128)
    ladder.check_torch_op(
        rms_norm_module.rms_norm_backward_op, (g, x, weight, gsum, 1e-6, 0.0), expected_shapes=[(4, 128), (128,)]
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


def test_torch_autograd_matches_torch_reference(rand):
    x, weight = _randn(rand, 9, 256, requires_grad=True), _randn(rand, 256, requires_grad=True)
    residual = _randn(rand, 9, 256, requires_grad=True)
    out, total = tpu_kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    # Fixed random cotangents, the same for both sides (a loss like sum(sin(out)) makes them depend on the output).
    d_out, d_total = _randn(rand, 9, 256), _randn(rand, 9, 256)
    grads = torch.autograd.grad((out * d_out).sum() + (total * d_total).sum(), (x, residual, weight))

    xr, rr, wr = (t.detach().clone().requires_grad_() for t in (x, residual, weight))
    total_r = xr + rr
    out_r = _torch_reference(total_r, wr, 1e-6)
    expected = torch.autograd.grad((out_r * d_out).sum() + (total_r * d_total).sum(), (xr, rr, wr))
    for name, a, e in zip(["d x", "d residual", "d weight"], grads, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m} ({rand})")

    x2 = x.detach().clone().requires_grad_()
    (tpu_kernels.rms_norm(x2) * 3).sum().backward()  # no weight: only x has a gradient
    assert x2.grad is not None and torch.isfinite(x2.grad).all()


def test_torch_bad_input(rand):
    x = _randn(rand, 4, 128)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got list"):
        tpu_kernels.rms_norm([[1.0]])
    with pytest.raises(ValueError, match=r"weight: expected a tensor on cpu .* got meta"):
        tpu_kernels.rms_norm(x, torch.empty(128, device="meta"))
    with pytest.raises(TypeError, match="x: dtype torch.complex64 is not supported"):
        tpu_kernels.rms_norm(x.to(torch.complex64))
    with pytest.raises(TypeError, match="x: expected dtype .* got float64"):
        tpu_kernels.rms_norm(x.double())
    with pytest.raises(ValueError, match=r"weight: expected shape \(128,\)"):
        tpu_kernels.rms_norm(x, _randn(rand, 64))
    with pytest.raises(ValueError, match="eps: expected a finite number >= 0, got -0.1"):
        tpu_kernels.rms_norm(x, None, -0.1)
    with pytest.raises(ValueError, match="residual: expected the shape of x"):
        tpu_kernels.fused_add_rms_norm(x, _randn(rand, 2, 128))
    # Meta tensors take the same checks: a wrong shape is refused before any shape inference.
    with pytest.raises(ValueError, match=r"weight: expected shape \(128,\)"):
        tpu_kernels.rms_norm(x.to("meta"), torch.empty(3, device="meta"))


def test_layer_passes_kernels_layer_validation():
    from kernels.layer.layer import _validate_layer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    _validate_layer(check_cls=Qwen3RMSNorm, cls=tpu_kernels.layers.RMSNorm, repo="tpu-kernels")


def _make_qwen3_norm_kernelizable(monkeypatch):
    """transformers 5.23 turns its `@use_kernel_forward_from_hub` into a no-op unless kernels >= 0.18.2, which is not
    released; mark the class the way that decorator would (kernel_layer_name), for this test only."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    if getattr(Qwen3RMSNorm, "kernel_layer_name", None) != "RMSNorm":
        monkeypatch.setattr(Qwen3RMSNorm, "kernel_layer_name", "RMSNorm", raising=False)


def test_kernelized_qwen3_gives_the_same_logits(rand, hub_root, monkeypatch):
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    _make_qwen3_norm_kernelizable(monkeypatch)
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
