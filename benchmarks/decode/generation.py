"""Greedy generation with each implementation, timed, tokens compared: the measurement both the CPU smoke and the
device mode make (torch and transformers imported by the caller's process only).

Implementations: "default" (transformers' own experts and attention), "experts" (our experts_forward through
transformers' experts interface) and "ours" (also our attention through `attn_implementation` = HUB_ATTENTION, and
RMSNorm and rotary by `kernelize` with the repo's layers), set up as the README shows. `kernelize` replaces the layers'
forwards for good, so the implementations run one after another over every batch, "ours" last.

Executions: "compiled" is what transformers does on a TPU with a static cache (it compiles the decode step's forward);
"op by op" passes `disable_compile=True`. On a CPU transformers does not compile, so the CPU smoke runs op by op.

On a TPU a step's time is (generate of prefill + N new tokens - generate of prefill + 1 token) / (N - 1): the prefill
and the first token cancel, leaving the decode steps, with a static cache so every step has the same shapes. The CPU
smoke, which only has to prove the path runs, divides one generate by N (prefill included) to save the second run.
N new tokens are forced (min_new_tokens = max_new_tokens) so an end-of-sequence token cannot shorten a run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import statistics
import sys
import tempfile
import time
from unittest import mock

EXPERTS_IMPLEMENTATION = "tpu_ragged_dot"  # the name the README registers our experts_forward under
HUB_REPO = "kernels-community/tpu-kernels"
# transformers keeps the padding mask under a static cache only for an attention implementation whose name holds
# "flash" (generation/utils.py drops an all-ones mask otherwise), and without it the static cache's empty slots would
# be attended to: the repo named with the function it wraps, as for continuous batching
HUB_ATTENTION = f"{HUB_REPO}:flash_attn_varlen_func"
KERNELIZED_LAYERS = {"RMSNorm": "RMSNorm", "rotary_pos_emb": "RotaryPosEmb"}  # transformers' hub name: our layer
IMPLS = ("default", "experts", "ours")
EXECUTIONS = ("compiled", "op by op")
ROOT = pathlib.Path(__file__).resolve().parents[2]
OURS_NOTE = (
    "all ours = our experts_forward, attention (attn_implementation) and RMSNorm + rotary (kernelize), loaded from a "
    "build of this checkout as from the Hub."
)


def register_experts(experts_forward) -> None:
    """Our experts_forward under transformers' experts interface, as the README shows."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, experts_forward)


def default_experts(model) -> str:
    """The experts implementation transformers picks when none is asked for ("grouped_mm", else "eager")."""
    return model.get_correct_experts_implementation(None)


def hub_layers(layer_name: str):
    """The Hub repo's layer as the README maps it for kernelize."""
    from kernels import LayerRepository

    return LayerRepository(HUB_REPO, layer_name=layer_name, version=1)


@contextlib.contextmanager
def checkout_build():
    """A Hub build of this checkout (scripts/build_hub.py into a temporary directory), named by LOCAL_KERNELS for
    HUB_REPO while the block runs, so "ours" measures the checkout, not the published package (processes started in
    the block inherit the variable); yields the build directory, for local_layers."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import build_hub
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    with tempfile.TemporaryDirectory() as root:
        build_hub.build(pathlib.Path(root) / "build")
        with mock.patch.dict(os.environ, {"LOCAL_KERNELS": f"{HUB_REPO}={root}"}):
            yield pathlib.Path(root) / "build"


def local_layers(build_dir):
    """kernelize's layers from a checkout_build directory: LocalLayerRepository, as LayerRepository(version=1) asks
    the Hub for the version before LOCAL_KERNELS is consulted."""
    from kernels import LocalLayerRepository

    return lambda layer_name: LocalLayerRepository(pathlib.Path(build_dir), layer_name=layer_name)


def use_all_of_ours(model, device_type: str, layers=hub_layers) -> list[str]:
    """Our attention (`attn_implementation` = HUB_ATTENTION; offline, LOCAL_KERNELS names a build) and RMSNorm and
    rotary (kernelize with `layers(layer_name)`, a kernels layer repository), as the README shows; for good. Returns
    the classes whose modules now run a forward of our package (kernelize acts only on transformers' classes marked
    for the Hub: Qwen3's RMSNorm and rotary function, none of Gemma 4's)."""
    from kernels import Mode, kernelize, use_kernel_mapping

    model.set_attn_implementation(HUB_ATTENTION)
    mapping = {name: {device_type: layers(layer)} for name, layer in KERNELIZED_LAYERS.items()}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device=device_type)
    ours = set()
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if forward is not None and getattr(forward, "__module__", "").startswith("_tpu_kernels_"):
            ours.add(type(module).__name__)
    return sorted(ours)


def _generate(model, prompt, new_tokens, sync, compiled):
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            disable_compile=not compiled,
        )
        sync()
        return out, time.perf_counter() - start


def _step_s(model, prompt, *, new_tokens, repeats, warmup, subtract_prefill, sync, compiled):
    """(tokens of the last run, median seconds a decode step)."""
    if warmup:
        _generate(model, prompt, new_tokens, sync, compiled)
    steps = []
    for _ in range(repeats):
        out, full = _generate(model, prompt, new_tokens, sync, compiled)
        if subtract_prefill:
            _, first = _generate(model, prompt, 1, sync, compiled)
            steps.append(max(full - first, 0.0) / (new_tokens - 1))
        else:
            steps.append(full / new_tokens)
    return out, statistics.median(steps)


def measure(
    model,
    prompts,
    impls,
    *,
    device_type: str,
    layers=hub_layers,
    executions=EXECUTIONS,
    new_tokens: int,
    repeats: int,
    warmup: bool,
    subtract_prefill: bool,
    sync=lambda: None,
) -> list[dict]:
    """One series {"execution", "rows"} per execution; a row {"batch", "impls": {impl: {"ms", "tokens_per_s",
    "experts_implementation", "attn_implementation", "kernelized"}}, "tokens_match", "new_tokens", "tokens_digest"}
    per prompt (one prompt a batch size). `layers` gives "ours" its kernelize layers (use_all_of_ours). Each impl
    generates `new_tokens` greedily (after one warm-up run when `warmup`), the median step of `repeats` runs; every
    impl's tokens are compared with the first's, per execution and batch."""
    least = 2 if subtract_prefill else 1  # with the subtraction a step is the difference of two runs
    if new_tokens < least:
        raise ValueError(f"new_tokens: expected at least {least}, got {new_tokens}")
    unknown = [i for i in impls if i not in IMPLS]
    if unknown or "ours" in impls[:-1]:
        raise ValueError(f"impls: expected a sequence of {IMPLS} with 'ours' (kernelized for good) last, got {impls}")
    series = [{"execution": e, "rows": [{"batch": p.shape[0], "impls": {}} for p in prompts]} for e in executions]
    tokens = {}  # (execution, batch index) -> {impl: tokens}
    for impl in impls:
        experts = EXPERTS_IMPLEMENTATION if impl in ("experts", "ours") else default_experts(model)
        model.set_experts_implementation(experts)
        kernelized = use_all_of_ours(model, device_type, layers) if impl == "ours" else []
        attention = model.config._attn_implementation
        for s in series:
            for i, (prompt, row) in enumerate(zip(prompts, s["rows"])):
                out, step = _step_s(
                    model,
                    prompt,
                    new_tokens=new_tokens,
                    repeats=repeats,
                    warmup=warmup,
                    subtract_prefill=subtract_prefill,
                    sync=sync,
                    compiled=s["execution"] == "compiled",
                )
                tokens.setdefault((s["execution"], i), {})[impl] = out
                row["impls"][impl] = {
                    "ms": step * 1e3,
                    "tokens_per_s": row["batch"] / step if step > 0 else float("inf"),
                    "experts_implementation": experts,
                    "attn_implementation": attention,
                    "kernelized": kernelized,
                }
    for s in series:
        for i, (prompt, row) in enumerate(zip(prompts, s["rows"])):
            outs = tokens[(s["execution"], i)]
            first = outs[impls[0]]
            row["tokens_match"] = all(bool((t.shape == first.shape) and (t == first).all()) for t in outs.values())
            row["new_tokens"] = int(first.shape[1] - prompt.shape[1])
            # the first impl's tokens, compact: what the ranks of an expert-parallel run compare
            row["tokens_digest"] = hashlib.sha256(first.cpu().numpy().tobytes()).hexdigest()[:16]
    return series


def versions() -> dict:
    """The versions a measured table depends on (None for a package that is not installed)."""
    from importlib import metadata

    out = {}
    for package in ("torch", "torch-tpu", "jax", "jaxlib", "libtpu", "transformers", "kernels", "tpu-kernels"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out
