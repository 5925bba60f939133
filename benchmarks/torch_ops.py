"""What TorchTPU's `jax_op` costs: the Hub build's torch ops on `tpu` tensors against the same JAX functions called
directly, by device time, on a TPU host with torch and torch-tpu installed (docs/torch_on_chip.md says how the test
machine gets them):

    python3 -m benchmarks.torch_ops [--package build/torch-tpu] [--out DIR] [--calls 20] [--only TEXT]

Each case calls a public torch function of the package (what users call) on `tpu` tensors. A dispatch mode records
the package's custom ops that call runs and their arguments; the JAX side then jits each recorded op's own JAX
function (`op.jax_fn`, what jax_op exports) on arrays of the same shapes made with jax.random on the chip (integer
metadata: the same values), so both sides run the same program. Device time is the profiler's: the sum of the
`XLA Modules` events on the chip over the traced calls, divided by the calls (the torch side may run more than one
program a call: each is listed). The host's wall-clock time per call is reported apart, labeled host time: what a
Python loop of eager calls waits for, not the chip's time.

Both sides run in one process and are traced by torch-tpu's profiler, which records every program the chip runs,
jax's included (one libtpu serves both there: torch-tpu's, 0.0.50). jax's own profiler is not used: with libtpu 0.0.50
loaded, jax 0.10.2's `start_trace` crashes (`PluginTracer::Start`). Where torch and jax compiled the same program,
the module names carry the same fingerprint.

Writes torch_ops.md and torch_ops.json to --out; prints the table. `--device cpu` runs the same wiring on the CPU (the
kernels in interpret mode; no device plane, so no device times): the test suite's smoke.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- the cases (torch side)
def _randn(torch, device, *shape, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(torch.bfloat16)


def _ops_check():
    """scripts/torch_tpu_ops_check.py: the Hub build's loader, the package-op recorder, the experts module."""
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import torch_tpu_ops_check

    return torch_tpu_ops_check


def cases(k, torch, device: str, small: bool = False) -> dict:
    """{case label: a no-argument function calling one public torch function of the package on `device` tensors}.
    `small`: the same calls at toy sizes (the CPU smoke)."""
    n = (lambda big, toy: toy) if small else (lambda big, toy: big)
    hidden, seq, experts, inter, ctx = n(4096, 256), n(2048, 128), n(128, 8), n(768, 128), n(1024, 64)
    out = {}
    for tokens in (8, n(4096, 64)):
        x, w = _randn(torch, device, tokens, hidden), _randn(torch, device, hidden, scale=0.1) + 1
        out[f"rms_norm tokens={tokens} hidden={hidden}"] = lambda x=x, w=w: k.rms_norm(x, w, 1e-6)
    q, kk, v = (_randn(torch, device, 1, seq, h, 128) for h in (32, 4, 4))
    out[f"flash_attn_func causal batch=1 seq={seq} heads=32/4 d=128"] = lambda: k.flash_attn_func(q, kk, v, causal=True)
    model_hidden = n(2048, 256)
    lhs, rhs = _randn(torch, device, experts * 4, model_hidden), _randn(torch, device, experts, model_hidden, 2 * inter)
    sizes = torch.full((experts,), 4, dtype=torch.int32, device=device)
    label = f"ragged_dot rows={experts * 4} groups={experts} K={model_hidden} N={2 * inter}"
    out[label] = lambda: k.ragged_dot(lhs, rhs, sizes)
    module = _ops_check().experts_module(  # Qwen3-30B-A3B's experts, top 8
        _randn(torch, device, experts, 2 * inter, model_hidden, scale=0.05),
        _randn(torch, device, experts, model_hidden, inter, scale=0.05),
    )
    for tokens in (8, 64):
        xs = _randn(torch, device, tokens, model_hidden)
        index = torch.stack([torch.randperm(experts)[:8] for _ in range(tokens)]).to(device)
        weights = torch.rand(tokens, 8).to(device, torch.bfloat16)
        out[f"experts_forward tokens={tokens} experts={experts} hidden={model_hidden} intermediate={inter} top_k=8"] = (
            lambda xs=xs, index=index, weights=weights: k.experts_forward(module, xs, index, weights)
        )
    pages_per_seq, page = ctx // 16, 16  # paged decode: 8 sequences, pages of 16
    qd = _randn(torch, device, 8, 32, 128)
    k_cache, v_cache = (_randn(torch, device, 8 * pages_per_seq + 8, page, 4, 128) for _ in range(2))
    kv_lens = torch.full((8,), ctx, dtype=torch.int32, device=device)
    table = torch.randperm(8 * pages_per_seq + 8)[: 8 * pages_per_seq].reshape(8, pages_per_seq)
    table, cu_q = table.to(torch.int32).to(device), torch.arange(9, dtype=torch.int32, device=device)
    out[f"ragged_paged_attention decode batch=8 context={ctx} page=16 heads=32/4 d=128"] = lambda: (
        k.ragged_paged_attention(qd, k_cache, v_cache, kv_lens, table, cu_q)
    )
    return out


# ----------------------------------------------------------------------------------------- recording the package's ops
def package_ops(k) -> dict:
    """{op name: the op object} of every custom op of the package that carries its JAX function."""
    found = {}
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith(k.__name__ + "."):
            for value in vars(module).values():
                if hasattr(value, "jax_fn") and hasattr(value, "_name"):
                    found[value._name.split("::")[-1]] = value
    return found


def _spec(value, torch):
    """One recorded argument as JSON: a tensor's shape and dtype (an integer tensor's values too), or the value."""
    if isinstance(value, torch.Tensor):
        spec = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        if not value.is_floating_point():
            spec["values"] = value.cpu().tolist()
        return {"tensor": spec}
    return {"static": value}


def record_ops(call, torch) -> list[dict]:
    """[{"op": name, "args": [spec, ...]}] of the package's custom ops `call()` runs, in order."""
    recorder = _ops_check().recording_package_ops()
    with recorder, torch.no_grad():
        call()
    return [{"op": name, "args": [_spec(a, torch) for a in args]} for name, args in recorder.calls]


def jax_program(op, specs: list[dict], seed: int):
    """(jitted op.jax_fn, its arguments on the default device): float tensors as random arrays of their shapes and
    dtypes, integer ones with their recorded values, the rest static."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import inputs

    args, static = [], []
    for i, spec in enumerate(specs):
        if "tensor" in spec:
            t = spec["tensor"]
            if "values" in t:
                args.append(
                    jax.device_put(np.asarray(t["values"], dtype=np.int32 if "int" in t["dtype"] else t["dtype"]))
                )
            else:
                args.append(inputs.normal(seed + i, tuple(t["shape"]), jnp.dtype(t["dtype"])))
        else:
            args.append(spec["static"])
            static.append(i)
    return jax.jit(op.jax_fn, static_argnums=tuple(static)), args


# ------------------------------------------------------------------------------------------------------ device times
def modules_in(trace_dir) -> list[tuple[str, float]]:
    """[(module name, device seconds)] of the chip's `XLA Modules` events in every trace file under trace_dir."""
    import jax

    from benchmarks import profiler

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    return [
        (e.name, float(e.duration_ns) * 1e-9)
        for f in files
        for e in profiler.module_events(jax.profiler.ProfileData.from_file(f))
    ]


def _summary(events, calls: int, host_s: float) -> dict:
    by_name = collections.defaultdict(list)
    for name, seconds in events:
        by_name[name].append(seconds)
    return {
        "device_s_per_call": sum(s for _, s in events) / calls if events else None,
        "programs": {name: {"executions": len(t), "median_s": statistics.median(t)} for name, t in by_name.items()},
        "host_s_per_call": host_s,
    }


def _timed_loop(call, sync, calls: int) -> float:
    sync(call())  # compile and first run, outside the timing
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = call()
    sync(out)
    return (time.perf_counter() - start) / calls


def _profiled(call, sync, calls: int, on_device: bool) -> dict:
    """{device_s_per_call, programs, host_s_per_call} of `call` (already run once): host time from a plain loop,
    device time from torch-tpu's profiler around a second loop (on a TPU only)."""
    host_s = _timed_loop(call, sync, calls)
    events = []
    if on_device:
        from torch_tpu._internal import profiler as tpu_profiler

        with tempfile.TemporaryDirectory(prefix="tpu-kernels-torch-trace-") as trace_dir:
            with tpu_profiler.profile(
                activities=[tpu_profiler.ProfilerActivity.TPU],
                on_trace_ready=tpu_profiler.xprof_trace_handler(trace_dir),
            ):
                out = None
                for _ in range(calls):
                    out = call()
                sync(out)
            events = modules_in(trace_dir)
    return _summary(events, calls, host_s)


def measure(args) -> dict:
    """Every case through torch on args.device, then its recorded ops as their JAX functions, each side profiled."""
    import importlib
    import importlib.metadata

    import jax
    import torch

    from benchmarks.device_timing import reason

    k = _ops_check().load_package(args.package)
    ops = package_ops(k)
    on_device = args.device != "cpu"
    interpret = importlib.import_module(f"{k.__name__}._pallas.common.interpret")

    def torch_sync(out):
        if on_device:
            torch.accelerator.synchronize()

    rows = []
    for label, call in cases(k, torch, args.device, small=not on_device).items():
        if args.only and not any(text in label for text in args.only):
            continue
        print(f"{label} ...", flush=True)
        row = {"case": label}
        try:
            recorded = record_ops(call, torch)
            row["ops"] = [r["op"] for r in recorded]
            with torch.no_grad():
                row["torch"] = _profiled(call, torch_sync, args.calls, on_device)
            programs = [jax_program(ops[r["op"]], r["args"], 1000 * i) for i, r in enumerate(recorded)]

            def jax_call(programs=programs):
                return [fn(*a) for fn, a in programs]

            if on_device:
                row["jax"] = _profiled(jax_call, jax.block_until_ready, args.calls, True)
            else:  # the CPU smoke: the JAX functions run once, in interpret mode
                with interpret.interpret_on_cpu():
                    row["jax"] = _profiled(jax_call, jax.block_until_ready, 1, False)
        except Exception as e:  # noqa: BLE001 - one case failing must not lose the others
            row["error"] = reason(e)
        rows.append(row)
        print(markdown([row], "").splitlines()[-1], flush=True)
    versions = {"torch": torch.__version__, "jax": jax.__version__}
    for name in ("torch-tpu", "libtpu"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    device = str(args.device)
    if on_device:
        device = torch.tpu.get_device_name() if hasattr(torch.tpu, "get_device_name") else jax.devices()[0].device_kind
    return {"device": device, "calls": args.calls, "versions": versions, "rows": rows}


# ------------------------------------------------------------------------------------------------------------ report
def _us(seconds):
    return "n/a" if seconds is None else f"{seconds * 1e6:,.1f}"


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| case | torch op: device µs / call | JAX direct: device µs / call | torch / JAX (device) "
        "| programs a torch call runs | host µs / call: torch | host µs / call: JAX |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['error']} | | | | | |")
            continue
        t, j = r["torch"], r["jax"]
        ratio = (
            f"{t['device_s_per_call'] / j['device_s_per_call']:.2f}x"
            if t["device_s_per_call"] and j["device_s_per_call"]
            else "n/a"
        )
        programs = "; ".join(f"{_us(p['median_s'])} µs x{p['executions']}" for p in t["programs"].values()) or "n/a"
        lines.append(
            f"| {r['case']} | {_us(t['device_s_per_call'])} | {_us(j['device_s_per_call'])} | {ratio} | {programs} "
            f"| {_us(t['host_s_per_call'])} | {_us(j['host_s_per_call'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", type=pathlib.Path, default=ROOT / "build" / "torch-tpu", help="the Hub build's variant")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "torch-ops")
    p.add_argument("--calls", type=int, default=20, help="traced calls per case")
    p.add_argument("--device", default="tpu", help="the torch device (tpu; cpu checks the wiring only)")
    p.add_argument("--only", action="append", help="the cases whose label holds this text (repeatable)")
    args = p.parse_args(argv)
    record = measure(args)
    timing = "device time from torch-tpu's profiler" if args.device != "cpu" else "CPU wiring check: no device times"
    header = (
        f"torch ops on `{args.device}` against the same JAX functions called directly, one process — measured "
        f"{record['device']} ({timing}, {args.calls} calls; "
        + ", ".join(f"{name} {v}" for name, v in record["versions"].items())
        + "); host µs = wall-clock per call of an eager loop (host time, not the chip's)"
    )
    text = markdown(record["rows"], header)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "torch_ops.md").write_text(text + "\n")
    (args.out / "torch_ops.json").write_text(json.dumps(record, indent=1))
    print(text)
    return 0 if all("error" not in r for r in record["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
