"""The package's torch ops on TorchTPU's `tpu` device against the same ops on CPU tensors, for the TPU test machine
once scripts/torch_tpu_parts.sh has installed torch and torch-tpu there and the probe (scripts/torch_tpu_probe.py)
found the chip:

    export PYTHONPATH=$PWD/build/torch-site-libtpu:$PYTHONPATH:$PWD/build/torch-site
    python3 scripts/torch_tpu_ops_check.py [--package build/torch-tpu] [--device tpu] [--only NAME ...]

The package is the Hub build (`make build`'s build/torch-tpu, imported from its folder as `kernels.get_local_kernel`
imports a variant; no `kernels` install needed). Every check draws fresh random inputs on the CPU (a seed per check),
runs the op on CPU tensors (the kernels in TPU interpret mode, the path the CPU test suite checks against its
references) and on copies on `--device`, and compares the outputs and, for the differentiable ops, the gradients of a
random projection of the outputs; the in-place cache writes compare the caches after the call; two checks run the op
under `torch.compile(fullgraph=True)` on the device. A result that is not finite fails. Prints one line a check and
`torch ops on <device>: N checks, F failures`; exit status 0 when none failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
# bf16 inputs throughout (the dtype the models run in); the chip's Mosaic kernels and the interpret mode's CPU
# arithmetic differ in accumulation order, so results agree to bf16's resolution, not bitwise.
TOLERANCE = {"atol": 3e-2, "rtol": 3e-2}


def load_package(path: pathlib.Path):
    """The Hub build's package imported from its folder, under a name of its own (as kernels' loader does)."""
    spec = importlib.util.spec_from_file_location(
        "tpu_kernels_hub_build", path / "__init__.py", submodule_search_locations=[str(path)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _randn(gen, *shape, scale=1.0):
    import torch

    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def run_on(fn, inputs, device, gen, *, grad=(), cotangents=None, compile_fullgraph=False):
    """fn's tensor outputs (then the gradients of sum(outputs * cotangents) in the inputs named by index in `grad`)
    with `inputs` copied to `device`, all brought back to the CPU. `cotangents` (a list): drawn from `gen` at the
    outputs' shapes by the first run, used as they are by the next."""
    import torch

    args = [
        t.detach().clone().to(device).requires_grad_(i in grad) if isinstance(t, torch.Tensor) else t
        for i, t in enumerate(inputs)
    ]
    call = torch.compile(fn, fullgraph=True) if compile_fullgraph else fn
    out = call(*args)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    results = [o.detach().cpu() for o in outs]
    if grad:
        if not cotangents:
            cotangents.extend(torch.randn(o.shape, generator=gen) for o in outs)
        loss = sum((o.float() * c.to(device)).sum() for o, c in zip(outs, cotangents))
        results += [g.cpu() for g in torch.autograd.grad(loss, [args[i] for i in grad])]
    return results


def compare(name, fn, inputs, device, gen, *, grad=(), compile_fullgraph=False) -> str:
    """One check: fn on `device` against fn on the CPU. Returns its report line; raises AssertionError on a
    mismatch."""
    import torch

    cotangents = []
    want = run_on(fn, inputs, "cpu", gen, grad=grad, cotangents=cotangents)
    got = run_on(fn, inputs, device, gen, grad=grad, cotangents=cotangents, compile_fullgraph=compile_fullgraph)
    assert len(got) == len(want), f"{name}: {len(got)} results on {device}, {len(want)} on the CPU"
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{name} result {i}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        )
        assert torch.isfinite(g.float()).all(), f"{name} result {i}: not finite on {device}"
        torch.testing.assert_close(g.float(), w.float(), **TOLERANCE, msg=lambda m, i=i: f"{name} result {i}: {m}")
        worst = max(worst, (g.float() - w.float()).abs().max().item())
    what = f"{len(want) - len(grad)} outputs" + (f", {len(grad)} gradients" if grad else "")
    return f"ok   {name}: {what}, max |{device} - cpu| {worst:.3g}"


# ------------------------------------------------------------------------------------------------------- the checks
def check_rms_norm(k, device, gen):
    x, w = _randn(gen, 64, 2048), _randn(gen, 2048, scale=0.1) + 1
    return [compare("rms_norm", lambda x, w: k.rms_norm(x, w, 1e-6), [x, w], device, gen, grad=(0, 1))]


def check_rms_norm_compiled(k, device, gen):
    x, w = _randn(gen, 8, 4096), _randn(gen, 4096, scale=0.1) + 1
    fn = lambda x, w: k.rms_norm(x, w, 1e-6)  # noqa: E731
    return [compare("rms_norm, torch.compile(fullgraph=True)", fn, [x, w], device, gen, compile_fullgraph=True)]


def check_fused_add_rms_norm(k, device, gen):
    x, r, w = _randn(gen, 64, 2048), _randn(gen, 64, 2048), _randn(gen, 2048, scale=0.1) + 1
    fn = lambda x, r, w: k.fused_add_rms_norm(x, r, w, 1e-6)  # noqa: E731
    return [compare("fused_add_rms_norm", fn, [x, r, w], device, gen, grad=(0, 1))]


def check_apply_rotary(k, device, gen):
    import torch

    q, kk = _randn(gen, 2, 8, 128, 128), _randn(gen, 2, 2, 128, 128)
    angles = torch.rand(1, 128, 64, generator=gen) * 6.28
    cos = torch.cat([angles.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([angles.sin()] * 2, -1).to(torch.bfloat16)
    fn = lambda q, kk, c, s: k.apply_rotary(q, kk, c, s)  # noqa: E731
    return [compare("apply_rotary", fn, [q, kk, cos, sin], device, gen, grad=(0, 1))]


def check_rms_norm_rope(k, device, gen):
    import torch

    q, kk = _randn(gen, 2, 8, 64, 128), _randn(gen, 2, 2, 64, 128)
    qw, kw = _randn(gen, 128, scale=0.1) + 1, _randn(gen, 128, scale=0.1) + 1
    angles = torch.rand(1, 64, 64, generator=gen) * 6.28
    cos = torch.cat([angles.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([angles.sin()] * 2, -1).to(torch.bfloat16)
    fn = lambda q, kk, qw, kw, c, s: k.rms_norm_rope(q, kk, qw, kw, c, s, 1e-6)  # noqa: E731
    return [compare("rms_norm_rope", fn, [q, kk, qw, kw, cos, sin], device, gen, grad=(0, 1))]


def check_rope_from_positions(k, device, gen):
    """The positions variants (cos/sin made in the kernel): YaRN scaling, then a partial rotary dim, bshd."""
    import torch

    q, kk = _randn(gen, 2, 64, 8, 128), _randn(gen, 2, 64, 2, 128)
    qw, kw = _randn(gen, 128, scale=0.1) + 1, _randn(gen, 128, scale=0.1) + 1
    positions = torch.randint(0, 4000, (2, 64), generator=gen)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}

    def rope(q, kk, positions):
        return k.apply_rotary_from_positions(q, kk, positions, theta=1e6, scaling=yarn, layout="bshd")

    def norm_rope(q, kk, qw, kw, positions):
        return k.rms_norm_rope_from_positions(q, kk, qw, kw, positions, theta=1e4, rotary_dim=64, layout="bshd")

    return [
        compare("apply_rotary_from_positions (yarn)", rope, [q, kk, positions], device, gen, grad=(0, 1)),
        compare(
            "rms_norm_rope_from_positions (rotary_dim 64)",
            norm_rope,
            [q, kk, qw, kw, positions],
            device,
            gen,
            grad=(0, 1),
        ),
    ]


def check_flash_attn_func(k, device, gen):
    q, kk, v = _randn(gen, 2, 256, 8, 128), _randn(gen, 2, 256, 2, 128), _randn(gen, 2, 256, 2, 128)
    causal = lambda q, kk, v: k.flash_attn_func(q, kk, v, causal=True)  # noqa: E731
    window = lambda q, kk, v: k.flash_attn_func(q, kk, v, causal=True, window_size=(63, 0), softcap=30.0)  # noqa: E731
    return [
        compare("flash_attn_func causal GQA", causal, [q, kk, v], device, gen, grad=(0, 1, 2)),
        compare("flash_attn_func window + softcap", window, [q, kk, v], device, gen, grad=(0, 1, 2)),
        compare(
            "flash_attn_func, torch.compile(fullgraph=True)", causal, [q, kk, v], device, gen, compile_fullgraph=True
        ),
    ]


def check_flash_attn_varlen_func(k, device, gen):
    import torch

    q, kk, v = _randn(gen, 300, 8, 128), _randn(gen, 300, 2, 128), _randn(gen, 300, 2, 128)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    fn = lambda q, kk, v, cq, ck: k.flash_attn_varlen_func(q, kk, v, cq, ck, 200, 200, causal=True)  # noqa: E731
    return [compare("flash_attn_varlen_func", fn, [q, kk, v, cu, cu], device, gen, grad=(0, 1, 2))]


def check_ragged_dot(k, device, gen):
    import torch

    lhs, rhs = _randn(gen, 256, 512), _randn(gen, 8, 512, 256, scale=0.05)
    sizes = torch.tensor([40, 0, 64, 20, 52, 0, 50, 30], dtype=torch.int32)
    return [compare("ragged_dot", k.ragged_dot, [lhs, rhs, sizes], device, gen, grad=(0, 1))]


def experts_module(gate_up_proj, down_proj):
    """An experts module as transformers' Qwen3-MoE experts present themselves to `experts_forward`: concatenated
    gate/up [E, 2I, H] and down [E, H, I] weights, SiLU, no biases."""
    import torch

    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(gate_up_proj)
    module.down_proj = torch.nn.Parameter(down_proj)
    module.num_experts, module.has_bias, module.is_transposed = gate_up_proj.shape[0], False, False
    module.is_concatenated, module.has_gate, module.act_fn = True, True, torch.nn.SiLU()
    return module


def _experts_module(gen, experts=8, hidden=256, intermediate=128):
    return experts_module(
        _randn(gen, experts, 2 * intermediate, hidden, scale=0.05),
        _randn(gen, experts, hidden, intermediate, scale=0.05),
    )


def check_experts_forward(k, device, gen):
    import copy

    import torch

    tokens, top_k = 16, 2
    x = _randn(gen, tokens, 256)
    index = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen).to(torch.bfloat16)
    cpu_module = _experts_module(gen)
    modules = {}

    def fn(x, index, weights):
        dev = x.device
        if dev not in modules:
            modules[dev] = copy.deepcopy(cpu_module).to(dev)
        return k.experts_forward(modules[dev], x, index, weights)

    return [compare("experts_forward", fn, [x, index, weights], device, gen, grad=(0, 2))]


def _quantized_experts_module(gen, dtype, experts=8, hidden=256, intermediate=128):
    """transformers' FP8-experts convention: int8 / float8_e4m3fn weights, float32 per-channel `<proj>_scale_inv`."""
    import torch

    module = _experts_module(gen, experts, hidden, intermediate)
    for proj in ("gate_up_proj", "down_proj"):
        e, n, _ = getattr(module, proj).shape
        if dtype == torch.int8:
            weight = torch.randint(-127, 128, getattr(module, proj).shape, generator=gen, dtype=torch.int8)
        else:
            weight = (torch.randn(getattr(module, proj).shape, generator=gen) * 100).clamp(-448, 448).to(dtype)
        setattr(module, proj, torch.nn.Parameter(weight, requires_grad=False))
        scale = (torch.rand(e, n, 1, generator=gen) + 0.5) / (100 * n**0.5)
        setattr(module, f"{proj}_scale_inv", torch.nn.Parameter(scale, requires_grad=False))
    return module


def _mxfp4_experts_module(gen, experts=8, hidden=256, intermediate=128):
    """gpt-oss checkpoints' MXFP4 experts: `<proj>_blocks` uint8 [E, out, in / 32, 16], `<proj>_scales` uint8."""
    import torch

    module = _experts_module(gen, experts, hidden, intermediate)
    for proj, (out, contraction) in (
        ("gate_up_proj", (2 * intermediate, hidden)),
        ("down_proj", (hidden, intermediate)),
    ):
        delattr(module, proj)
        blocks = torch.randint(0, 256, (experts, out, contraction // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(118, 125, (experts, out, contraction // 32), generator=gen, dtype=torch.uint8)
        module.register_buffer(f"{proj}_blocks", blocks)
        module.register_buffer(f"{proj}_scales", scales)
    return module


def check_experts_forward_quantized(k, device, gen):
    """int8 and fp8 e4m3 expert weights with per-channel scales, then MXFP4 laid out by prepare_mxfp4_experts
    (inference: forward only)."""
    import copy

    import torch

    tokens, top_k = 16, 2
    x = _randn(gen, tokens, 256)
    index = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen).to(torch.bfloat16)
    lines = []
    for name, cpu_module in (
        ("int8", _quantized_experts_module(gen, torch.int8)),
        ("fp8 e4m3", _quantized_experts_module(gen, torch.float8_e4m3fn)),
        ("MXFP4, prepare_mxfp4_experts", _mxfp4_experts_module(gen)),
    ):
        modules, mxfp4 = {}, name.startswith("MXFP4")

        def fn(x, index, weights, cpu_module=cpu_module, modules=modules, mxfp4=mxfp4):
            dev = x.device
            if dev not in modules:
                modules[dev] = copy.deepcopy(cpu_module).to(dev)
                if mxfp4:
                    k.prepare_mxfp4_experts(modules[dev])
            with torch.no_grad():
                return k.experts_forward(modules[dev], x, index, weights)

        lines.append(compare(f"experts_forward {name}", fn, [x, index, weights], device, gen))
    return lines


def check_reshape_and_cache_flash_fp8(k, device, gen):
    import torch

    key, value = _randn(gen, 12, 2, 128), _randn(gen, 12, 2, 128)
    k_cache = (torch.randn(8, 16, 2, 128, generator=gen) * 50).to(torch.float8_e4m3fn)
    v_cache = (torch.randn(8, 16, 2, 128, generator=gen) * 50).to(torch.float8_e4m3fn)
    slots = torch.randperm(128, generator=gen)[:12].to(torch.int64)
    scales = torch.rand(2, generator=gen) * 0.02 + 0.01

    def fn(key, value, k_cache, v_cache, slots, scales):
        k.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, "fp8", scales[:1], scales[1:])
        return k_cache, v_cache

    inputs = [key, value, k_cache, v_cache, slots, scales]
    return [compare("reshape_and_cache_flash fp8 e4m3 (in place)", fn, inputs, device, gen)]


def check_reshape_and_cache_flash(k, device, gen):
    import torch

    key, value = _randn(gen, 12, 2, 128), _randn(gen, 12, 2, 128)
    k_cache, v_cache = _randn(gen, 8, 16, 2, 128), _randn(gen, 8, 16, 2, 128)
    slots = torch.randperm(128, generator=gen)[:12].to(torch.int64)

    def fn(key, value, k_cache, v_cache, slots):
        k.reshape_and_cache_flash(key, value, k_cache, v_cache, slots)
        return k_cache, v_cache

    return [compare("reshape_and_cache_flash (in place)", fn, [key, value, k_cache, v_cache, slots], device, gen)]


def check_ragged_paged_attention(k, device, gen):
    import torch

    q = _randn(gen, 6, 8, 128)
    k_cache, v_cache = _randn(gen, 8, 16, 2, 128), _randn(gen, 8, 16, 2, 128)
    kv_lens = torch.tensor([40, 17], dtype=torch.int32)
    pages = torch.tensor([[5, 1, 6], [3, 0, 7]], dtype=torch.int32)
    cu_q = torch.tensor([0, 5, 6], dtype=torch.int32)  # a prefill chunk of 5 and one decode token
    fn = k.ragged_paged_attention
    return [compare("ragged_paged_attention", fn, [q, k_cache, v_cache, kv_lens, pages, cu_q], device, gen)]


def check_flash_attn_with_kvcache(k, device, gen):
    import torch

    q = _randn(gen, 2, 1, 8, 128)
    k_cache, v_cache = _randn(gen, 2, 64, 2, 128), _randn(gen, 2, 64, 2, 128)
    seqlens = torch.tensor([30, 50], dtype=torch.int32)
    fn = lambda q, kc, vc, n: k.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, causal=True)  # noqa: E731
    return [compare("flash_attn_with_kvcache", fn, [q, k_cache, v_cache, seqlens], device, gen)]


CHECKS = {
    f.__name__.removeprefix("check_"): f
    for f in (
        check_rms_norm,
        check_rms_norm_compiled,
        check_fused_add_rms_norm,
        check_apply_rotary,
        check_rms_norm_rope,
        check_rope_from_positions,
        check_flash_attn_func,
        check_flash_attn_varlen_func,
        check_ragged_dot,
        check_experts_forward,
        check_experts_forward_quantized,
        check_reshape_and_cache_flash,
        check_reshape_and_cache_flash_fp8,
        check_ragged_paged_attention,
        check_flash_attn_with_kvcache,
    )
}


def recording_package_ops():
    """A TorchDispatchMode whose `calls` list holds (op name, args) of every op of a Hub build (namespace
    `_tpu_kernels_<hash>`) run under it, in order; the dispatch is this thread's only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PackageOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            namespace, _, name = func.name().partition("::")
            if namespace.startswith("_tpu_kernels_"):
                self.calls.append((name.split(".")[0], args))
            return func(*args, **(kwargs or {}))

    return PackageOps()


def run_checks(names, run, what: str) -> int:
    """Each name's check (`run(name)`: its report lines, raising on a failure), printed with its seconds; a failure
    printed with its traceback and counted, the others still run. Ends with `<what>: N checks, F failures`; returns
    the exit status (1 when any failed)."""
    checks, failures = 0, 0
    for name in names:
        start = time.perf_counter()
        try:
            lines = run(name)
            checks += len(lines)
            for line in lines:
                print(f"{line} ({time.perf_counter() - start:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing check must not hide the others
            checks += 1
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
    print(f"{what}: {checks} checks, {failures} failures")
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", type=pathlib.Path, default=ROOT / "build" / "torch-tpu", help="the Hub build's folder")
    p.add_argument("--device", default="tpu", help="the device checked against the CPU (default tpu)")
    p.add_argument("--only", action="append", choices=sorted(CHECKS), help="run these checks only (repeatable)")
    args = p.parse_args(argv)
    import torch

    k = load_package(args.package)
    print(f"torch {torch.__version__}, package {args.package}, device {args.device}", flush=True)
    names = list(args.only or CHECKS)
    seeds = {name: 1000 + index for index, name in enumerate(names)}

    def run(name):
        return CHECKS[name](k, args.device, torch.Generator().manual_seed(seeds[name]))

    return run_checks(names, run, f"torch ops on {args.device}")


if __name__ == "__main__":
    sys.exit(main())
