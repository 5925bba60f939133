"""Rotary embeddings, torch side: the custom ops (opcheck, fake/meta shapes, torch.compile), autograd against torch's
own autograd of the formula, torch-side bad input, the inverse frequencies against transformers' rope init functions,
and the `rotary_pos_emb` kernelize layer in a tiny random Qwen3 model."""

import ladder
import numpy as np
import pytest
import torch

import tpu_kernels
from tpu_kernels import rotary_ops
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


def test_apply_rotary_op_checks(rand):
    q, k = _randn(rand, 2, 4, 8, 128, requires_grad=True), _randn(rand, 2, 2, 8, 128, requires_grad=True)
    cos, sin = _randn(rand, 1, 8, 128, requires_grad=True), _randn(rand, 1, 8, 128)
    ladder.check_torch_op(
        rotary_ops.apply_rotary_op, (q, k, cos, sin, False, "bhsd"), expected_shapes=[(2, 4, 8, 128), (2, 2, 8, 128)]
    )


def test_apply_rotary_backward_op_checks(rand):
    gq, gk = _randn(rand, 2, 8, 4, 128), _randn(rand, 2, 8, 1, 128)
    cos, sin = _randn(rand, 2, 8, 64), _randn(rand, 2, 8, 64)
    ladder.check_torch_op(
        rotary_ops.apply_rotary_backward_op,
        (gq, gk, cos, sin, True, "bshd"),
        expected_shapes=[(2, 8, 4, 128), (2, 8, 1, 128)],
    )


def test_rms_norm_rope_op_checks(rand):
    q, k = _randn(rand, 1, 2, 8, 128, requires_grad=True), _randn(rand, 1, 1, 8, 128, requires_grad=True)
    qw, kw = _randn(rand, 128, requires_grad=True), _randn(rand, 128)
    cos, sin = _randn(rand, 1, 8, 128), _randn(rand, 1, 8, 128)
    ladder.check_torch_op(
        rotary_ops.rms_norm_rope_op,
        (q, k, qw, kw, cos, sin, 1e-6, 0.0, False, "bhsd"),
        expected_shapes=[(1, 2, 8, 128), (1, 1, 8, 128)],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_apply_rotary_matches_reference(rand, dtype):
    q, k = _randn(rand, 2, 5, 3, 128, dtype=dtype), _randn(rand, 2, 5, 1, 128, dtype=dtype)
    cos, sin = _randn(rand, 2, 5, 64, dtype=dtype), _randn(rand, 2, 5, 64, dtype=dtype)  # partial rotary
    out_q, out_k = tpu_kernels.apply_rotary(q, k, cos, sin, layout="bshd")
    assert out_q.dtype == dtype and out_q.shape == q.shape and out_k.shape == k.shape
    jdtype = ladder.jnp.dtype(str(dtype).removeprefix("torch."))
    for out, x in ((out_q, q), (out_k, k)):
        ladder.assert_close(
            out.float().numpy(), _torch_rope(x, cos, sin, head_axis=2).float().numpy(), dtype=jdtype, context=repr(rand)
        )


def test_torch_autograd_matches_torch_reference(rand):
    """The fused norm + rope: d q, d k (transpose rotation + RMSNorm backward kernels), d weights, d cos, d sin."""
    shapes = dict(
        q=(2, 3, 6, 128), k=(2, 1, 6, 128), q_weight=(128,), k_weight=(128,), cos=(1, 6, 128), sin=(1, 6, 128)
    )
    inputs = {name: _randn(rand, *shape, requires_grad=True) for name, shape in shapes.items()}
    out_q, out_k = tpu_kernels.rms_norm_rope(*inputs.values(), 1e-6, weight_offset=0.5)
    # Fixed random cotangents, the same for both sides (a loss like sum(sin(out)) makes them depend on the output).
    d_q, d_k = _randn(rand, *shapes["q"]), _randn(rand, *shapes["k"])
    grads = torch.autograd.grad((out_q * d_q).sum() + (out_k * d_k).sum(), tuple(inputs.values()))

    ref = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (0.5 + w)

    ref_q = _torch_rope(norm(ref["q"], ref["q_weight"]), ref["cos"], ref["sin"])
    ref_k = _torch_rope(norm(ref["k"], ref["k_weight"]), ref["cos"], ref["sin"])
    expected = torch.autograd.grad((ref_q * d_q).sum() + (ref_k * d_k).sum(), tuple(ref.values()))
    for name, a, e in zip(inputs, grads, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=2e-4, msg=lambda m: f"d {name}: {m} ({rand})")


def test_torch_bad_input(rand):
    q, k = _randn(rand, 2, 4, 8, 128), _randn(rand, 2, 2, 8, 128)
    cos = _randn(rand, 1, 8, 128)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor, got list"):
        tpu_kernels.apply_rotary([[1.0]], k, cos, cos)
    with pytest.raises(ValueError, match=r"cos: expected a tensor on cpu .* got meta"):
        tpu_kernels.apply_rotary(q, k, cos.to("meta"), cos)
    with pytest.raises(TypeError, match="q: expected dtype .* got float16"):
        tpu_kernels.apply_rotary(q.half(), k.half(), cos, cos)
    with pytest.raises(ValueError, match=r"rotary_dim \(cos.shape\[-1\]\): expected an even number"):
        tpu_kernels.apply_rotary(q, k, cos[..., :63], cos[..., :63])
    with pytest.raises(ValueError, match=r"rotary_dim \(cos.shape\[-1\]\): expected at most head_dim = 128"):
        tpu_kernels.apply_rotary(q, k, _randn(rand, 1, 8, 256), _randn(rand, 1, 8, 256))
    with pytest.raises(ValueError, match=r"sin: expected the shape of cos"):
        tpu_kernels.apply_rotary(q, k, cos, _randn(rand, 1, 7, 128))
    with pytest.raises(ValueError, match="layout: expected 'bhsd' or 'bshd'"):
        tpu_kernels.apply_rotary(q, k, cos, cos, layout="bsd")
    with pytest.raises(ValueError, match=r"k_weight: expected shape \(128,\)"):
        tpu_kernels.rms_norm_rope(q, k, _randn(rand, 128), _randn(rand, 64), cos, cos)
    # Meta tensors take the same checks.
    with pytest.raises(ValueError, match="k: expected the batch, seq and head_dim of q"):
        tpu_kernels.apply_rotary(q.to("meta"), torch.empty(2, 2, 9, 128, device="meta"), cos.to("meta"), cos.to("meta"))


# ------------------------------------------------------------------------------------------ cos/sin from positions
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 16}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _positions(rand, *shape, high=40000):
    return torch.from_numpy(rand.rng.integers(0, high, shape).astype("int32"))


def test_apply_rotary_from_positions_op_checks(rand):
    q, k = _randn(rand, 2, 4, 8, 128, requires_grad=True), _randn(rand, 2, 2, 8, 128, requires_grad=True)
    scalars = (1e6, 0, *rotary_ops.scaling_to_scalars(YARN))
    ladder.check_torch_op(
        rotary_ops.apply_rotary_from_positions_op,
        (q, k, _positions(rand, 2, 8), *scalars, False, "bhsd"),
        expected_shapes=[(2, 4, 8, 128), (2, 2, 8, 128)],
    )


def test_rms_norm_rope_from_positions_op_checks(rand):
    q, k = _randn(rand, 1, 8, 2, 128, requires_grad=True), _randn(rand, 1, 8, 1, 128, requires_grad=True)
    qw, kw = _randn(rand, 128, requires_grad=True), _randn(rand, 128)
    theta, rotary_dim, *rest = (1e4, 64, *rotary_ops.scaling_to_scalars(None))
    args = (q, k, qw, kw, _positions(rand, 1, 8), theta, 1e-6, 0.0, rotary_dim, *rest, True, "bshd")
    ladder.check_torch_op(
        rotary_ops.rms_norm_rope_from_positions_op, args, expected_shapes=[(1, 8, 2, 128), (1, 8, 1, 128)]
    )


def test_scaling_scalars_round_trip():
    """The rope parameters survive the trip through the ops' scalar arguments."""
    for scaling in (
        None,
        YARN,
        LLAMA3,
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "proportional", "partial_rotary_factor": 0.25},
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "truncate": False,
        },
    ):
        rope_type, *numbers, truncate = rotary_ops.scaling_to_scalars(scaling)
        assert rotary_ops.scaling_from_scalars(rope_type, numbers, truncate) == scaling


def test_torch_from_positions_matches_torch_reference_with_autograd(rand):
    """rms_norm_rope_from_positions (llama3 scaling): outputs and d q, d k, d weights against torch's autograd of the
    formula on transformers-style tables; apply_rotary_from_positions with k=None against the same tables."""
    shapes = dict(q=(2, 3, 6, 128), k=(2, 1, 6, 128), q_weight=(128,), k_weight=(128,))
    inputs = {name: _randn(rand, *shape, requires_grad=True) for name, shape in shapes.items()}
    positions = _positions(rand, 2, 6, high=20000)
    cos, sin = (
        torch.from_numpy(np.array(t))
        for t in rotary_ops.api.rope_cos_sin(positions.numpy(), head_dim=128, theta=5e5, scaling=LLAMA3)
    )
    out_q, out_k = rotary_ops.rms_norm_rope_from_positions(
        *inputs.values(), positions, theta=5e5, eps=1e-6, weight_offset=0.5, scaling=LLAMA3
    )
    d_q, d_k = _randn(rand, *shapes["q"]), _randn(rand, *shapes["k"])  # fixed cotangents, the same for both sides
    grads = torch.autograd.grad((out_q * d_q).sum() + (out_k * d_k).sum(), tuple(inputs.values()))

    ref = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (0.5 + w)

    ref_q, ref_k = (_torch_rope(norm(ref[x], ref[w]), cos, sin) for x, w in (("q", "q_weight"), ("k", "k_weight")))
    torch.testing.assert_close(out_q, ref_q, rtol=1e-4, atol=1e-4, msg=lambda m: f"q: {m} ({rand})")
    expected = torch.autograd.grad((ref_q * d_q).sum() + (ref_k * d_k).sum(), tuple(ref.values()))
    for name, a, e in zip(inputs, grads, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=2e-4, msg=lambda m: f"d {name}: {m} ({rand})")

    q = _randn(rand, 2, 6, 3, 128, dtype=torch.bfloat16)
    out, none = rotary_ops.apply_rotary_from_positions(q, None, positions, theta=5e5, scaling=LLAMA3, layout="bshd")
    assert none is None and out.dtype == torch.bfloat16
    ladder.assert_close(
        out.float().numpy(),
        _torch_rope(q, cos, sin, head_axis=2).float().numpy(),
        dtype=ladder.jnp.dtype("bfloat16"),
        context=repr(rand),
    )


def test_torch_from_positions_bad_input(rand):
    q, k = _randn(rand, 2, 4, 8, 128), _randn(rand, 2, 2, 8, 128)
    with pytest.raises(ValueError, match=r"positions: expected values in \[0, 16777216\)"):
        rotary_ops.apply_rotary_from_positions(q, k, torch.full((2, 8), 1 << 24, dtype=torch.int32), theta=1e4)
    with pytest.raises(TypeError, match="positions: expected dtype"):
        rotary_ops.apply_rotary_from_positions(q, k, torch.zeros(2, 8), theta=1e4)
    with pytest.raises(ValueError, match="scaling: rope_type 'llama3' needs"):
        rotary_ops.apply_rotary_from_positions(
            q, k, _positions(rand, 2, 8), theta=1e4, scaling={"rope_type": "llama3", "factor": 8.0}
        )
    with pytest.raises(ValueError, match=r"k_weight: expected shape \(128,\)"):
        rotary_ops.rms_norm_rope_from_positions(
            q, k, _randn(rand, 128), _randn(rand, 64), _positions(rand, 1, 8), theta=1e4
        )


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

    from kernels import use_kernel_forward_from_hub

    hub_function = use_kernel_forward_from_hub("rotary_pos_emb")(modeling_qwen3.apply_rotary_pos_emb)
    _validate_layer(check_cls=type(hub_function), cls=tpu_kernels.layers.RotaryPosEmb, repo="tpu-kernels")
    assert tpu_kernels.layers.apply_rotary_transformers is tpu_kernels.layers.RotaryPosEmb


def _make_qwen3_rope_kernelizable(monkeypatch):
    """transformers 5.23 turns `@use_kernel_forward_from_hub("rotary_pos_emb")` on apply_rotary_pos_emb and
    `@use_kernelized_func(apply_rotary_pos_emb)` on Qwen3Attention into no-ops unless kernels >= 0.18.2 (not
    released). Apply them the way those decorators would, for this test only: the function becomes a hub function
    module (kernel_layer_name "rotary_pos_emb") that Qwen3Attention calls and registers in its `_kernel_funcs`."""
    from transformers.models.qwen3 import modeling_qwen3

    from kernels import use_kernel_forward_from_hub, use_kernelized_func

    original = modeling_qwen3.apply_rotary_pos_emb
    if getattr(original, "kernel_layer_name", None) == "rotary_pos_emb":
        return original
    hub_function = use_kernel_forward_from_hub("rotary_pos_emb")(original)
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", hub_function)
    init = modeling_qwen3.Qwen3Attention.__init__
    patched = use_kernelized_func(hub_function)(type("Probe", (), {"__init__": init})).__init__
    monkeypatch.setattr(modeling_qwen3.Qwen3Attention, "__init__", patched)
    return hub_function


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


def test_kernelized_qwen3_gives_the_same_logits(rand, hub_root, monkeypatch):
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    hub_function = _make_qwen3_rope_kernelizable(monkeypatch)
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
