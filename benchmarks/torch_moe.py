"""DEVICE MODE ONLY (a TPU host): transformers' default experts path on the `tpu` device vs our torch
`experts_forward`, at each MoE benchmark shape. Imported only by `benchmarks/test_moe.py::test_transformers_experts`
after it checked that a TPU is present, so CPU runs never import torch from here.

Both run the same experts module (transformers' Qwen3MoeExperts built from a config with the shape's hidden,
intermediate and activation; Gemma 4's experts compute the same function), with the benchmark's random routing:
  - "transformers default": the module's forward with the experts implementation transformers picks by default
    ("grouped_mm", i.e. aten::_grouped_mm, which TorchTPU lowers to XLA's ragged dot; "eager" if it cannot dispatch);
  - "torch experts_forward": tpu_kernels.experts_forward(module, ...) (the torch custom op over our JAX kernels).
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

from .ops import _moe

ROOT = pathlib.Path(__file__).resolve().parent.parent
_ACT = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def _experts_module(shape, torch):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=shape["hidden"],
        moe_intermediate_size=shape["intermediate"],
        num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"],
        hidden_act=_ACT[shape["activation"]],
    )
    config._experts_implementation = "grouped_mm"
    module = Qwen3MoeExperts(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return module.to(device="tpu", dtype=torch.bfloat16).eval()


def time_case(benchmark, case, torch_impl: str, dev) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "torch-ext"))
    import tpu_kernels

    shape = case.shape
    module = _experts_module(shape, torch)
    index, weights = _moe.routing_of(shape)
    tokens = index.shape[0]
    x = torch.randn(tokens, shape["hidden"], generator=torch.Generator().manual_seed(1)).to("tpu", torch.bfloat16)
    idx = torch.from_numpy(np.asarray(index, np.int64)).to("tpu")
    w = torch.from_numpy(np.asarray(weights)).to("tpu", torch.bfloat16)
    if torch_impl == "transformers default":

        def run():
            try:
                return module(x, idx, w)
            except (ValueError, ImportError, RuntimeError, NotImplementedError):
                module.config._experts_implementation = "eager"  # grouped_mm cannot dispatch here
                return module(x, idx, w)
    else:

        def run():
            return tpu_kernels.experts_forward(module, x, idx, w)

    def call():
        with torch.no_grad():
            out = run()
        torch.tpu.synchronize() if hasattr(torch, "tpu") and hasattr(torch.tpu, "synchronize") else out.cpu()

    call()  # compile outside the timed rounds
    benchmark.extra_info.update(
        case_id=case.id,
        impl=f"torch: {torch_impl}",
        label=f"measured {dev.kind} (torch, tpu device)",
        device_kind=dev.kind,
        batch=shape.batch,
        hbm_bytes=case.op.hbm_bytes(shape),
        experts_implementation=module.config._experts_implementation
        if torch_impl != "torch experts_forward"
        else "tpu_kernels.experts_forward",
    )
    benchmark.pedantic(call, rounds=20, iterations=1, warmup_rounds=1)
