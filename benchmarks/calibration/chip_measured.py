"""The benchmark suites' programs timed on a TPU v5e chip (chip_v5e.json), rebuilt as measured points.

`chip_points.py` gathers every device-time figure of a `python -m benchmarks` run on a TPU into chip_<gen>.json: per
point the kernel, the op, the benchmark Shape (its dict), the implementation ("kernel": ours, "default": the XLA path,
"baseline:<name>": another library's) and the median of the profiler's per-call device times, with the run's
provenance (device kind, jax, libtpu build, date). Device time only: no host dispatch. Each point is rebuilt here from
the suite that timed it: the Case whose op and shape match, its function for that implementation and its model
arguments, exactly as `benchmarks.modeled` hands cases to the model.

Families group the programs whose modeled time comes from the same mechanisms: our Pallas kernels per kernel (their
schedule and DMAs), XLA's fused elementwise/reduction programs (norms, rotary: XLA's own cycle estimate), XLA's scatter
into a KV cache, XLA's ragged dot (a Mosaic kernel XLA emits itself, which the model cannot see into), and each
baseline library's kernels.
"""

from __future__ import annotations

import functools
import json
import pathlib

from .points import MeasuredPoint

GEN = "v5e"
DATA = pathlib.Path(__file__).with_name(f"chip_{GEN}.json")
TIMING = "python -m benchmarks on the chip: median of the profiler's per-call device times (no host dispatch)"

# Our Pallas kernels, one family per kernel; XLA's paths and the baselines by the mechanism their time rests on.
_KERNEL_FAMILIES = {
    "rms_norm": "chip_rms_norm_kernel",
    "rotary": "chip_rotary_kernel",
    "kv_cache": "chip_kv_cache_kernel",
    "ragged_dot": "chip_ragged_dot_kernel",
    "moe": "chip_moe_kernel",
    "paged_attention": "chip_paged_attention_kernel",
    "flash_attention": "chip_flash_attention_kernel",
}
_DEFAULT_FAMILIES = {
    "rms_norm": "chip_xla_fusion",
    "rotary": "chip_xla_fusion",
    "kv_cache": "chip_xla_scatter",
    "ragged_dot": "chip_xla_ragged_dot",
    "moe": "chip_xla_ragged_dot",
    "paged_attention": "chip_xla_paged_attention",
    "flash_attention": "chip_xla_attention",
}
_BASELINE_FAMILIES = {
    "our rope + XLA scatter": "chip_xla_scatter",  # our rotary kernel, then XLA's scatter: the scatter dominates
    "megablox": "chip_megablox",
    "tokamax": "chip_tokamax_ragged_dot",
    "vllm": "chip_vllm_moe",
    "dense masked": "chip_xla_dense_moe",
    "jax_rpa": "chip_jax_rpa",
    "jax_paged": "chip_jax_paged_attention",
    "vllm_rpa": "chip_vllm_rpa",
    "splash": "chip_splash_attention",
    "jax_flash": "chip_jax_flash_attention",
    "parts": "chip_paged_parts",  # a mixed step as our paged attention (decodes) and flash attention (prefill) calls
}
# Baselines whose name two kernels' suites share: tokamax's attention is not its ragged dot
_KERNEL_BASELINE_FAMILIES = {"flash_attention": {"tokamax": "chip_tokamax_attention"}}

# Families out of the fit: the measured ratio (modeled v5e / measured TPU v5e device time, over the family) and the
# mechanism suspected.
OUT_OF_FIT = {
    "chip_megablox": (
        "modeled/measured 1.01-1.42 (median 1.19), with the reads at 0.92 of the HBM bandwidth that bring our grouped "
        "matmuls into the fit: not examined (megablox's tiles at these shapes, its steps' cost)"
    ),
    "chip_tokamax_ragged_dot": (
        "modeled/measured 1.14-1.42 (median 1.22): tokamax's kernels at its default tiles (its autotuning data has no "
        "entry for "
        "these shapes): not examined"
    ),
    "chip_vllm_moe": (
        "modeled/measured 0.96-1.18 at 1-8 tokens, 7.7 and 26.6 at 64 and 256, 53 and 421 at 4,096 and 32,768 rows: "
        "the model cannot pair 9 branches "
        "inside the kernel's loops with its code and counts them as run at every iteration, and its loops sized at "
        "run time once"
    ),
    "chip_xla_paged_attention": (
        "modeled/measured 0.57-1.05 (median 0.91): XLA's gather of each sequence's pages (a DMA a page, or their "
        "bytes) and its masked attention; a cache small enough for VMEM is prefetched whole or in slices and gathered "
        "there (the gather charged its bytes as if in HBM: not examined); Qwen3's caches at pages of 64 0.57-0.89 "
        "(float8 0.57-0.68), Gemma 4 full's bf16 cache 0.74-0.84: not examined"
    ),
    "chip_jax_rpa": (
        "modeled/measured 0.45-63.1 (median 2.50): 0.98-1.08 at decode batch 8 of Qwen3 (Gemma 4 full 0.45), 2.9-9.0 "
        "at 64-256, 63 for the mixed "
        "batch: JAX's ragged_paged_attention walks sequences and blocks in loops sized at run time, which the model "
        "cannot pair with their trip counts: not examined"
    ),
    "chip_jax_paged_attention": "modeled/measured 1.44-2.61 (median 1.59): JAX's paged_attention: not examined",
    "chip_splash_attention": (
        "modeled/measured 1.05-1.51 (median 1.19): splash attention (MQA per kv head) at its own blocks, modeled about "
        "a fifth slow, 1.44-1.51 at Qwen3 causal and gpt-oss full: not examined"
    ),
    "chip_tokamax_attention": "modeled/measured 1.05-1.92 (median 1.38, 3 points): tokamax's attention: not examined",
    "chip_paged_parts": (
        "modeled/measured 0.99-1.07 (median 1.052, 3 points): a mixed step as two of our kernels in one program "
        "(ragged paged attention on its decodes, flash attention on its prefill chunks); each family alone is in the "
        "fit, their sum just past the median bound: not examined"
    ),
    "chip_vllm_rpa": (
        "modeled/measured 0.47-1.39 (median 0.73): bf16 0.47-0.76 (the model sees vLLM's RPA v3 at about twice its "
        "chip speed), float8 0.90-1.39: not examined (K and V in one cache, its own DMA pipeline)"
    ),
}
# Single points out of the fit within an in-fit family: programs of a few µs, where fixed costs the model does not
# hold dominate (a kernel's start and end, the cost of each XLA op beyond its schedule). XLA's KV write is four to six
# ops (the slots' select, a scatter per cache, the rotation and the fp8 casts): under 10 µs.
SMALL_S = 6e-6
SMALL_S_OF = {"chip_xla_scatter": 10e-6, "chip_xla_fusion": 10e-6}
SMALL = {
    "chip_rms_norm_kernel": (
        "measured under 6 µs: modeled/measured 1.13-1.59; the assumed 1 µs launch of a kernel is ~0.6 µs on the chip "
        "(1-token RMSNorm: 0.74 µs measured, 0.17 µs of schedule and DMAs)"
    ),
    "chip_rotary_kernel": (
        "measured under 6 µs: modeled/measured 0.71-1.44; fixed costs of a kernel's start and end, 0.6-1.5 µs on the "
        "chip against the 1 µs assumed"
    ),
    "chip_kv_cache_kernel": (
        "measured under 6 µs (8 tokens): modeled/measured 1.07-1.34; a kernel's fixed start and end costs, ~0.6 µs on "
        "the chip against the 1 µs assumed"
    ),
    "chip_xla_scatter": (
        "measured under 10 µs (8 tokens): modeled/measured 0.42-0.75; four to six XLA ops, each ~0.1-0.6 µs beyond "
        "its schedule on the chip, which the model does not charge"
    ),
    "chip_xla_fusion": (
        "measured under 10 µs: modeled/measured 0.10-0.82; each XLA op costs ~0.1-0.6 µs beyond its schedule on the "
        "chip (1-token RMSNorm: 3 ops, 1.46 µs measured, 0.2 µs modeled), which the model does not charge: the "
        "per-head norm + RoPE programs at 64 tokens (7-9 µs, about ten ops) 0.70-0.74 once their identical q and k "
        "fusions are each timed from their one schedule (XLA's estimate for one of them had hidden the ops' costs)"
    ),
}

# The test suite's subset (names): points of every in-fit family near its median, cheap to compile.
QUICK = (
    "rms_norm/rms_norm kernel tokens=4096 hidden=2048 bfloat16",
    "rms_norm/fused_add_rms_norm kernel tokens=32768 hidden=2048 bfloat16",
    "rotary/apply_rotary kernel tokens=256 model=qwen3-30b-a3b phase=decode q_heads=32 kv_heads=4 head_dim=128 "
    "rotary_dim=128 bfloat16",
    "rotary/rms_norm_rope kernel tokens=2048 model=qwen3-30b-a3b phase=prefill q_heads=32 kv_heads=4 head_dim=128 "
    "rotary_dim=128 bfloat16",
    "rms_norm/rms_norm default tokens=4096 hidden=2048 bfloat16",
    "rms_norm/fused_add_rms_norm default tokens=32768 hidden=2048 bfloat16",
    "rotary/apply_rotary default tokens=256 model=qwen3-30b-a3b phase=decode q_heads=32 kv_heads=4 head_dim=128 "
    "rotary_dim=128 bfloat16",
    "rotary/rms_norm_rope default tokens=2048 model=gemma4-sliding phase=prefill q_heads=16 kv_heads=8 head_dim=256 "
    "rotary_dim=256 bfloat16",
    "ragged_dot/gate_up kernel tokens=8 phase=decode model=qwen3-30b-a3b experts=128 top_k=8 hidden=2048 "
    "intermediate=768 activation=silu bfloat16",
    "moe/experts_forward kernel tokens=8 phase=decode model=qwen3-30b-a3b experts=128 top_k=8 hidden=2048 "
    "intermediate=768 activation=silu bfloat16",
    "paged_attention/ragged_paged_attention kernel batch=64 model=gemma4-sliding phase=decode context=4096 page=64 "
    "q_heads=16 kv_heads=8 head_dim=256 window=1024 bfloat16",
    "flash_attention/forward kernel seq=4096 model=gemma4-sliding mask=causal layout=dense q_heads=16 kv_heads=8 "
    "head_dim=256 window=1024 bfloat16",
    "kv_cache/write_kv_cache kernel tokens=2048 model=qwen3-30b-a3b phase=prefill q_heads=32 kv_heads=4 head_dim=128 "
    "bfloat16",
    "moe/experts_forward dense masked tokens=64 phase=decode model=qwen3-30b-a3b experts=128 top_k=8 hidden=2048 "
    "intermediate=768 activation=silu bfloat16",
    "ragged_dot/down default tokens=8 phase=decode model=qwen3-30b-a3b experts=128 top_k=8 hidden=2048 "
    "intermediate=768 activation=silu bfloat16",
    "kv_cache/write_kv_cache default tokens=2048 model=gemma4-sliding phase=prefill q_heads=16 kv_heads=8 head_dim=256 "
    "bfloat16",
    "kv_cache/rope_and_write_kv_cache default tokens=256 model=qwen3-30b-a3b phase=decode q_heads=32 kv_heads=4 "
    "head_dim=128 bfloat16",
)


def _excluded(fam: str, entry: dict) -> str:
    """Why a point of an in-fit family is out of the fit by its shape, or ""."""
    shape = entry["shape"]
    if fam == "chip_xla_scatter" and shape.get("model") == "gemma4-full" and "float8" in str(shape.get("dtype")):
        return (
            "Gemma 4's full layers in float8: XLA lays those caches out head-major and relays the whole cache out and "
            "back around its scatter (layout copies); measured 950-1430 µs, modeled/measured 0.33-0.74: the model "
            "costs the copies by their bytes at the DMA bandwidth, ~3x under the chip's time for these transposes, "
            "not examined"
        )
    if fam == "chip_flash_attention_kernel" and shape.get("head_dim") == 512 and entry["op"] == "backward":
        return (
            "Gemma 4's full layers' backward at head dim 512 (the fused dq kernel on 512 x 512 blocks): "
            "modeled/measured 0.69 (74.3 ms measured as the benchmark's backward program; the same backward timed "
            "alone by the sweep 58.2 ms): not examined"
        )
    if fam == "chip_xla_ragged_dot" and str(shape.get("dtype")) in ("int8", "float8_e4m3fn", "mxfp4"):
        return (
            "quantized expert weights: XLA's path relays the 8-bit (MXFP4: packed) weights out and dequantizes them "
            "before its ragged dots; the model costs those copies and fusions by their bytes, and on the chip they "
            "take longer than bf16's twice-as-many bytes (Gemma 4, 64 tokens: int8 7,265 µs measured against bf16's "
            "5,118; modeled 4,367 and 5,217); modeled/measured 0.45-0.85: not examined"
        )
    if fam == "chip_xla_ragged_dot" and shape.get("rows", 0) >= 32768:
        return (
            "prefill of 32,768 rows (4,096 tokens): modeled/measured 0.80-0.83 where the same program at 4,096 rows is "
            "0.99-1.00 and the ragged dots alone 1.00-1.05 at every size measured; the part the model misses at this "
            "size (the two ragged dots take 1,143 and 762 grid steps, the weights' relayouts 3.7 ms) not examined"
        )
    if fam == "chip_xla_dense_moe" and "mxfp4" in str(shape.get("dtype")):
        return (
            "gpt-oss's MXFP4 experts, dense: the program unpacks every expert's weights before its einsums (70 ms "
            "measured at 8 tokens); modeled/measured 0.49: not examined"
        )
    if fam == "chip_xla_dense_moe" and shape.get("tokens") == 1:
        return (
            "one token: XLA lowers each einsum to a multiply-reduce fusion (no dot), timed from its schedule, whose "
            "DMAs the model reads short of the weights (Qwen3's gate/up shape: 567 µs modeled for 805 MB, under the "
            "983 µs they take at the table bandwidth); modeled/measured 0.69-1.07: not examined"
        )
    if (
        fam == "chip_kv_cache_kernel"
        and shape.get("model") == "gemma4-full"
        and "float8" in str(shape.get("dtype"))
        and shape.get("tokens", 0) <= 8
    ):
        return (
            "Gemma 4's full layers in float8 at 8 tokens: the head-major cache's word groups, 64 iterations of a loop "
            "in one grid step; modeled/measured 1.7-2.0 (7.5 and 10.7 µs measured): not examined"
        )
    return ""


def family(kernel: str, impl: str) -> str:
    if impl == "kernel":
        return _KERNEL_FAMILIES[kernel]
    if impl == "default":
        return _DEFAULT_FAMILIES[kernel]
    baseline = impl.removeprefix("baseline:")
    return _KERNEL_BASELINE_FAMILIES.get(kernel, {}).get(baseline) or _BASELINE_FAMILIES[baseline]


def key(entry: dict) -> str:
    """A point's key in the JSON file: kernel, op, implementation and shape."""
    shape = ", ".join(f"{k}={v}" for k, v in entry["shape"].items())
    return f"{entry['kernel']}/{entry['op']} {entry['impl']} ({shape})"


def name(entry: dict, shape_id: str) -> str:
    impl = entry["impl"].removeprefix("baseline:")
    return f"{entry['kernel']}/{entry['op']} {impl} {shape_id}"


@functools.cache
def load() -> tuple[dict, ...]:
    return tuple(json.loads(DATA.read_text()))


def _case(entry: dict):
    from benchmarks import suite

    for case in suite.get(entry["kernel"]).cases():
        if case.op.name == entry["op"] and case.shape.as_dict() == entry["shape"]:
            return case
    raise LookupError(f"no case of the {entry['kernel']} suite matches {key(entry)}")


def _point(entry: dict) -> MeasuredPoint:
    from benchmarks import modeled

    case = _case(entry)
    fn, args = modeled.case_item(case, entry["impl"])
    point_name = name(entry, case.shape.id)
    fam = family(entry["kernel"], entry["impl"])
    note = OUT_OF_FIT.get(fam, "") or _excluded(fam, entry)
    if not note and entry["device_us"] * 1e-6 < SMALL_S_OF.get(fam, SMALL_S):
        note = SMALL.get(fam, "")
    return MeasuredPoint(
        family=fam,
        name=point_name,
        gen=GEN,
        measured_s=entry["device_us"] * 1e-6,
        source=(
            f"benchmarks/calibration/{DATA.name}: {key(entry)}; {entry['device_kind']}, jax {entry['jax']}, "
            f"{entry['platform_version']}, {entry['date']}"
        ),
        fn=fn,
        args=args,
        in_fit=not note,
        timing=TIMING,
        note=note,
    )


def _applies(entry: dict) -> bool:
    """Whether the entry's implementation can be built here: ours and XLA's always; a baseline only where its library
    is installed (tokamax, tpu-inference are benchmark extras)."""
    case = _case(entry)
    why_not = case.op.impls(case.shape).get(entry["impl"], "no such implementation")
    if why_not is not None and not entry["impl"].startswith("baseline:"):
        raise LookupError(f"{key(entry)}: {why_not}")
    return why_not is None


def points(*, quick: bool = False) -> list[MeasuredPoint]:
    """Every point of the file whose implementation can be built here, or with `quick` the test suite's subset."""
    wanted = set(QUICK) if quick else None
    return [_point(e) for e in load() if (wanted is None or name(e, _case(e).shape.id) in wanted) and _applies(e)]
