"""model_function: the static TPU performance model of one JAX function.

Every figure produced here is MODELED (not measured): see README.md for what the
model takes into account and what it ignores.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import glob
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np

from ..deviceless import subprocess_env
from . import bundles as B
from . import chips as C
from . import traffic as T
from . import xla_ragged_dot

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")


# Gathers and scatters stay on the TensorCore when modeling. XLA offloads some to the SparseCore (v5p/v6e/v7x), but an
# offloaded op carries no cycle estimate (it would count as 0 µs) and its async form cannot be printed back from the
# executable (compiled.as_text() fails), which drops the estimates of every other XLA op too. The TensorCore form is
# estimated by XLA like any op: routing work (sorts, gathers, scatters) is charged, not hidden.
MODELING_LIBTPU_FLAGS = (
    "--xla_tpu_enable_offloading_gather_to_sparsecore=false "
    "--xla_tpu_offload_gather_to_sparsecore=false "
    "--xla_tpu_enable_offloading_scatter_to_sparsecore=false"
)


@dataclasses.dataclass
class KernelModel:
    """One Pallas (Mosaic) kernel of the program. Times in seconds, all modeled."""

    label: str
    hlo_name: str
    kernel_name: str
    grid: tuple
    steps: int
    trip_count: int
    # schedule (pre-delay bundles = cycles; see bundles.py)
    prologue_bundles: int
    epilogue_bundles: int
    loop_body_bundles: int  # all regions executed
    step_cycles_min: int
    step_cycles_max: int
    step_cycles_mean: float
    fill_iteration_cycles: int
    final_bundles: dict  # summary of the post delay-converter schedule
    mxu_ops_per_step: float  # vmatmul instructions per grid step (mean)
    mxu_flops: float  # from vmatmul count x MXU tile (includes padding)
    dot_flops: float  # logical dot_general flops of the kernel body
    dma_instructions_per_iteration: int
    # traffic
    hbm_bytes: int
    hbm_bytes_in: int
    hbm_bytes_out: int
    hbm_bytes_bound: str  # "exact" | "lower" (some traffic not countable) | "upper" | "approximate" (both)
    hbm_bytes_from_schedule: int  # the part counted from the schedule's DMA instructions (SMEM operands, manual
    # DMAs, kernels with no pallas_call); the rest is the BlockSpec pipeline's, from the jaxpr
    dma_descriptors: float  # DMAs issued (pipeline block transfers, the kernel's own copies, SMEM copies)
    dma_runs: float  # their contiguous runs in HBM (perf_model.dma_shape)
    dma_shape_s: float  # DMA-engine time for them by their shape (descriptors and runs), before overlap with compute
    blocks: list
    # time
    compute_s: float
    hbm_s: float
    pipeline_steps: float  # grid iterations + iterations of the kernel's own DMA loops
    step_overhead_s: float  # their per-step cost (chips.Calibration.step_overhead_s each)
    modeled_s: float
    bound: str  # "compute" or "hbm" (which dominates summed over steps)
    warnings: list  # something the model expected to read and could not (a mismatch worth looking into)
    notes: list  # what no static model can know here, and how it was counted instead


@dataclasses.dataclass
class XlaOpModel:
    label: str
    name: str
    estimated_cycles: int
    modeled_s: float
    basis: str = "estimated_cycles"  # or "bytes_moved": a layout copy or a prefetch, costed by the bytes it moves;
    # or "schedule": an elementwise / reduction op, timed from its own schedule and DMAs as a kernel is; or
    # "scatter_rows": a scatter, by the rows it writes (chips.Calibration.xla_scatter_row_s); or "matmul_schedule" /
    # "matmul_stream": a matmul, by its schedule's cycles or, where more, its operands' and result's HBM stream
    bytes_moved: int | None = None


@dataclasses.dataclass
class ProgramModel:
    label: str  # e.g. "modeled v6e"
    gen: str
    chip: dict
    modeled_s: float  # kernels + XLA ops
    kernels: list
    xla_ops: list
    xla_optimal_seconds: float | None  # XLA cost_analysis, covers XLA ops only
    cost_analysis: dict
    memory_analysis: dict
    warnings: list
    notes: list

    @property
    def modeled_us(self) -> float:
        return self.modeled_s * 1e6

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self), default=_json_default))


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


# --------------------------------------------------------------------------- compile


def _dtype_name(dt) -> str:
    return str(jax.numpy.dtype(dt))


def _arg_specs(args):
    return jax.tree.map(
        lambda x: (
            ("__spec__", tuple(int(d) for d in x.shape), _dtype_name(x.dtype))
            if hasattr(x, "shape") and hasattr(x, "dtype")
            else x
        ),
        args,
    )


_COMPILE_CACHE: dict[str, dict] = {}

# Only the LLO passes the model reads are dumped (pre-delay and final bundles, their schedule-analysis summaries):
# the full dump is ~50 MB per compile and triples its wall time. `keep_dumps` gets the full dump.
_DUMP_PASS_REGEX = "packed-bundles-post-ra|final_bundles"


def compile_deviceless(
    fn, args, gen: str = "v6e", *, dump: bool = True, keep_dumps: str | None = None, timeout: float = 900.0
) -> tuple[dict, dict[str, str]]:
    """Compile jax.jit(fn)(*args) for `gen` in a fresh subprocess with no TPU.

    `fn` must be picklable by reference (a module-level function, or a
    functools.partial of one with picklable arguments). Returns (compile_info,
    dump_files) where dump_files maps "<hlo name>/<kind>" to file text for each
    Mosaic kernel (kinds: "pre_delay", "final", "profile").
    """
    (result,) = compile_deviceless_many([(fn, args)], gen, dump=dump, keep_dumps=keep_dumps, timeout=timeout)
    if isinstance(result, Exception):
        raise result
    return result


def donated(fn, argnums) -> functools.partial:
    """`fn` with its arguments at `argnums` donated where the model compiles it (jax.jit's donate_argnums): the state
    of an in-place program, which a server donates call to call. A state not donated is copied whole before an
    in-place write (XLA's scatter and a Pallas output aliased to its input alike), a copy the served program never
    pays. The donation travels with the function (an attribute of the partial, pickled with it)."""
    fn = functools.partial(fn)
    fn.donate_argnums = tuple(argnums)
    return fn


def _pickle_item(fn, args):
    specs = _arg_specs(args)
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001
        raise TypeError(
            "perf_model needs `fn` picklable by reference (a module-level function or a "
            f"functools.partial of one); got {fn!r}: {e}"
        ) from e
    return fn, specs


def compile_deviceless_many(
    items,
    gen: str = "v6e",
    *,
    dump: bool = True,
    keep_dumps: str | None = None,
    timeout: float | None = None,
    topology: str | None = None,
    mesh_axes: tuple | None = None,
    _xla_text_dump: bool = False,
) -> list:
    """Compile several (fn, args) for `gen` in ONE fresh subprocess (the subprocess's start, importing jax and
    loading libtpu, is most of a single compile's wall time). Returns, per item, (compile_info, dump_files) as
    `compile_deviceless` does, or the Exception that item raised (the others are still compiled). Cached per item.
    `keep_dumps` copies item i's dumps to `keep_dumps/<i>` (to `keep_dumps` itself for a single item).

    Sharded programs: `topology` names a multi-chip slice of `gen` (e.g. "v6e:2x4") and `mesh_axes` ((name, size),
    ...) a mesh over all its chips; an item is then (fn, args, partition specs), the specs one tuple per array leaf
    of args (jax.tree.leaves order; () replicated), and the program is compiled with those shardings under that mesh
    (a shard_map in fn finds it as the context mesh). The compiled HLO is the per-chip SPMD program."""
    chip = C.get_chip(gen)
    topology = topology or chip.topology
    results: list = [None] * len(items)
    todo = []  # (index, key, fn, specs, partition specs)
    for i, (fn, args, *pspecs) in enumerate(items):
        try:
            fn, specs = _pickle_item(fn, args)
            pspecs = tuple(pspecs[0]) if pspecs else None
            key = hashlib.sha256(
                pickle.dumps((fn, specs, topology, mesh_axes, pspecs)) + repr(dump).encode()
            ).hexdigest()
        except Exception as e:  # noqa: BLE001
            results[i] = e
            continue
        if key in _COMPILE_CACHE and keep_dumps is None:
            results[i] = _COMPILE_CACHE[key]
        else:
            todo.append((i, key, fn, specs, pspecs))
    if not todo:
        return results
    blob = pickle.dumps((topology, [(fn, specs, pspecs) for _, _, fn, specs, pspecs in todo], mesh_axes))
    timeout = timeout if timeout is not None else 300.0 + 120.0 * len(todo)
    tmp = tempfile.mkdtemp(prefix="perf_model_")
    try:
        dump_dir = os.path.join(tmp, "dump")
        os.makedirs(dump_dir)
        payload = os.path.join(tmp, "payload.pkl")
        out_path = os.path.join(tmp, "out.json")
        with open(payload, "wb") as f:
            pickle.dump(([p for p in sys.path if p], blob, dump_dir if dump else None), f)
        env = subprocess_env()
        env.pop("TPU_ACCELERATOR_TYPE", None)  # the topology, not the host, names the chip
        flags = f"{env.get('LIBTPU_INIT_ARGS', '')} {MODELING_LIBTPU_FLAGS}".strip()
        if dump:
            flags = f"{flags} --xla_jf_dump_to={dump_dir} --xla_mosaic_dump_to={dump_dir}".strip()
            if keep_dumps is None:
                flags += f" --xla_jf_dump_llo_pass_label_regex={_DUMP_PASS_REGEX}"
        env["LIBTPU_INIT_ARGS"] = flags
        if _xla_text_dump:  # compiled.as_text() failed for these programs: read XLA's own text dump instead
            xla_dir = os.path.join(tmp, "xla")
            env["PERF_MODEL_XLA_DUMP"] = xla_dir
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={xla_dir} --xla_dump_hlo_as_text".strip()
        try:
            proc = subprocess.run(
                [sys.executable, _WORKER, payload, out_path], env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            # every item of the subprocess is lost, not the caller's other chunks (a long run records and goes on)
            err = TimeoutError(f"deviceless compile for {gen} timed out after {timeout:.0f} s ({len(todo)} programs)")
            for i, *_ in todo:
                results[i] = err
            return results
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
            err = RuntimeError(f"deviceless compile for {gen} failed (rc={proc.returncode}):\n{tail}")
            for i, *_ in todo:
                results[i] = err
            return results
        with open(out_path) as f:
            outs = json.load(f)
        retry = []
        for j, ((i, key, *_), info) in enumerate(zip(todo, outs)):
            if "error" in info and info.get("as_text_failed") and not _xla_text_dump:
                retry.append(i)
                continue
            if "error" in info:
                results[i] = RuntimeError(
                    f"deviceless compile for {gen} failed: {info['error']}\n{info.get('traceback', '')}"
                )
                continue
            item_dir = os.path.join(dump_dir, str(j))
            files = _collect_kernel_dumps(item_dir, info["hlo"]) if dump else {}
            if keep_dumps:
                dest = keep_dumps if len(items) == 1 else os.path.join(keep_dumps, str(i))
                shutil.copytree(item_dir, dest, dirs_exist_ok=True)
            _COMPILE_CACHE[key] = (info, files)
            results[i] = (info, files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if retry:
        again = compile_deviceless_many(
            [items[i] for i in retry],
            gen,
            dump=dump,
            timeout=timeout,
            topology=topology,
            mesh_axes=mesh_axes,
            _xla_text_dump=True,
        )
        for i, r in zip(retry, again):
            results[i] = r
    return results


_CUSTOM_CALL_RE = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=.*custom_call_target=\"tpu_custom_call\"", re.M)
_INSTRUCTION_START_RE = re.compile(r"^(?:[ \t]*(?:ROOT[ \t]+)?%\S+[ \t]*=|\}[ \t]*$)", re.M)


def _mosaic_calls(hlo: str) -> list[tuple[str, str]]:
    """(hlo instruction name, decoded body text) of every Mosaic custom call, in order."""
    out = []
    for m in _CUSTOM_CALL_RE.finditer(hlo):
        # The instruction runs to the next one (or the computation's end): attributes may span lines (tokamax's
        # kernel_metadata holds newlines, and its body comes after them).
        nxt = _INSTRUCTION_START_RE.search(hlo, m.end())
        line = hlo[m.start() : nxt.start() if nxt else len(hlo)]
        body = ""
        bm = re.search(r'"body":"([^"]+)"', line)
        if bm:
            try:
                body = base64.b64decode(bm.group(1)).decode("latin-1")
            except Exception:  # noqa: BLE001
                body = ""
        out.append((m.group(1), body))
    return out


def _collect_kernel_dumps(dump_dir: str, hlo: str) -> dict[str, str]:
    files = _collect_xla_op_dumps(dump_dir, hlo)
    for name, _ in _mosaic_calls(hlo):
        for kind, suffix in (
            ("pre_delay", "packed-bundles-post-ra.txt"),
            ("final", "final_bundles.txt"),
            ("profile", "hlo-static-bundle-profile.txt"),
        ):
            cands = [
                f
                for f in glob.glob(os.path.join(dump_dir, f"*-{glob.escape(name)}-*{suffix}"))
                if "schedule-analysis" not in os.path.basename(f)
            ]
            if cands:
                with open(sorted(cands)[-1]) as fh:
                    files[f"{name}/{kind}"] = fh.read()
    return files


def _collect_xla_op_dumps(dump_dir: str, hlo: str) -> dict[str, str]:
    """The pre-delay schedule of every top-level XLA op the model times from its own schedule (`scheduled_xla_ops`):
    libtpu compiles each XLA op to LLO like a Mosaic kernel and dumps it as `<id>-<op name>-<NN>-<stage>.txt`."""
    wanted = set(scheduled_xla_ops(hlo)) | set(matmul_ops(hlo))
    files = {}
    if not wanted or not os.path.isdir(dump_dir):
        return files
    pattern = re.compile(r"^\d+-(.+)-\d+-packed-bundles-post-ra\.txt$")
    for f in sorted(os.listdir(dump_dir)):
        m = pattern.match(f)
        if m and m.group(1) in wanted:
            with open(os.path.join(dump_dir, f)) as fh:
                files[f"{m.group(1)}/pre_delay"] = fh.read()
    return files


_COMPUTATION_RE = re.compile(r"^(?:ENTRY )?%(\S+) \(.*?^\}", re.M | re.S)
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*)$", re.M)
# Ops whose work is not elementwise or a reduction over streamed windows: matmuls (XLA's estimate holds for them),
# custom calls, data-dependent loops and control flow, collectives.
_NOT_STREAMING_RE = re.compile(
    r"\s(?:dot|convolution|custom-call|scatter|gather|sort|while|conditional|call|all-reduce|all-gather|reduce-scatter|"
    r"all-to-all|collective-permute|send|recv|infeed|outfeed|rng[\w-]*)\("
)


def scheduled_xla_ops(hlo: str) -> list[str]:
    """Top-level XLA ops that carry a cycle estimate and are elementwise or reductions (fused or not; no matmul,
    scatter, sort, loop, custom call): the model times them from their own schedule and DMAs, as a kernel's (see
    `_assemble`)."""
    computations = {m.group(1): m.group(0) for m in _COMPUTATION_RE.finditer(hlo)}
    entry = re.search(r"^ENTRY .*?^\}", hlo, re.M | re.S)
    out = []
    for m in _INSTRUCTION_RE.finditer(entry.group(0) if entry else ""):
        name, rest = m.group(1), m.group(2)
        if '"estimated_cycles"' not in rest or _NOT_STREAMING_RE.search(" " + rest.split(", metadata=")[0]):
            continue
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if called and _NOT_STREAMING_RE.search(computations.get(called.group(1), " custom-call(")):
            continue
        out.append(name)
    return out


_MATMUL_RE = re.compile(r"\s(?:dot|convolution)\(")
_TYPED_RE = re.compile(r"(\w+)\[([\d,]*)\]\{([^}]*)\}")
_OP_RE = re.compile(r"(.*?)\s[\w-]+\(([^)]*)\)")  # an instruction's result type(s), then its operands


def _hbm_bytes(types: str) -> int:
    """Bytes of the arrays typed in `types` (a result type, or a tuple of them) that live in HBM: a layout marked
    S(1) is VMEM, S(2) SMEM."""
    return sum(_type_bytes(t, d) or 0 for t, d, layout in _TYPED_RE.findall(types) if "S(" not in layout)


def _entry_result_types(text: str) -> dict[str, str]:
    """{instruction: its result type(s)} of the entry computation's text."""
    types = {}
    for m in _INSTRUCTION_RE.finditer(text):
        op = _OP_RE.match(m.group(2))
        types[m.group(1)] = op.group(1) if op else ""
    return types


def matmul_ops(hlo: str) -> dict[str, tuple[int, int]]:
    """{top-level op: (HBM bytes it reads, HBM bytes it writes)} for each op that carries a cycle estimate and is a
    matmul (a dot or convolution, fused with elementwise work or not; nothing else `_NOT_STREAMING_RE` names): its
    operands and result, each counted once where it lies in HBM."""
    computations = {m.group(1): m.group(0) for m in _COMPUTATION_RE.finditer(hlo)}
    entry = re.search(r"^ENTRY .*?^\}", hlo, re.M | re.S)
    text = entry.group(0) if entry else ""
    types = _entry_result_types(text)
    out = {}
    for m in _INSTRUCTION_RE.finditer(text):
        name, rest = m.group(1), m.group(2)
        head = rest.split(", metadata=")[0]
        if '"estimated_cycles"' not in rest:
            continue
        called = re.search(r"calls=%([\w.\-]+)", rest)
        body = computations.get(called.group(1), " custom-call(") if called else head
        if not _MATMUL_RE.search(" " + body) or _NOT_STREAMING_RE.search(" " + _MATMUL_RE.sub(" matmul(", body)):
            continue
        op = _OP_RE.match(head)
        if op is None:
            continue
        operands = re.findall(r"%([\w.\-]+)", op.group(2))
        out[name] = (sum(_hbm_bytes(types.get(o, "")) for o in operands), _hbm_bytes(op.group(1)))
    return out


_ASYNC_COPY_RE = re.compile(
    r"^\s*%(\S+)\s*=\s*\((\w+)\[([\d,]*)\]\{([^}]*)\},\s*\w+\[[\d,]*\]\{([^}]*)\}.*?\)\s+copy-start\(", re.M
)


# An asynchronous slice: ((its operand), the slice, a semaphore) = slice-start(operand): XLA prefetches a part of an
# operand into VMEM so (a paged cache small enough to sit in VMEM, in four slices).
_ASYNC_SLICE_RE = re.compile(
    r"^\s*%(\S+)\s*=\s*\(\(\w+\[[\d,]*\]\{([^}]*)\}\),\s*(\w+)\[([\d,]*)\]\{([^}]*)\}.*?\)\s+slice-start\(", re.M
)


def async_copies(hlo: str) -> dict[str, int]:
    """{copy-start or slice-start: bytes} for each top-level asynchronous copy between HBM and VMEM: XLA's prefetch
    of an operand, or of a slice of one, into VMEM (or its eviction). Not an op with an estimate, but the bytes cross
    HBM beside the ops it overlaps."""
    out = {}
    entry = re.search(r"^ENTRY .*?^\}", hlo, re.M | re.S)
    text = entry.group(0) if entry else ""
    for m in _ASYNC_SLICE_RE.finditer(text):
        if ("S(1)" in m.group(2)) != ("S(1)" in m.group(5)):
            nbytes = _type_bytes(m.group(3), m.group(4))
            if nbytes:
                out[m.group(1)] = nbytes
    for m in _ASYNC_COPY_RE.finditer(text):
        if ("S(1)" in m.group(4)) == ("S(1)" in m.group(5)):  # HBM to HBM, or VMEM to VMEM: not a prefetch
            continue
        if "cross_program_prefetch_index" in text[m.end() : text.find("\n", m.end())]:
            # A parameter prefetched for the program's next run, behind the run before it: the tutorial's
            # jnp.matmul at 4096^3 prefetches its 32 MiB lhs so and measures no time for it on the v5e.
            continue
        nbytes = _type_bytes(m.group(2), m.group(3))
        if nbytes:
            out[m.group(1)] = nbytes
    return out


def _async_copy_models(chip, label: str, hlo: str, kernels: list, xla_ops: list) -> list:
    """XLA's prefetches into VMEM (and evictions to HBM) run beside the ops between their copy-start and copy-done,
    and share HBM with them: windows that overlap are one group, which takes max(its ops' times, all its HBM bytes
    (the ops' and the copies') / BW). What that adds to the ops' times is the copies' cost (split by their bytes): a
    copy beside compute-bound ops is free up to the bytes that fit under them, one beside nothing costs its bytes."""
    copies = async_copies(hlo)
    if not copies:
        return []
    entry = re.search(r"^ENTRY .*?^\}", hlo, re.M | re.S)
    order = {m.group(1): i for i, m in enumerate(_INSTRUCTION_RE.finditer(entry.group(0) if entry else ""))}
    done = {}  # copy-start -> position of its copy-done
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%(\S+)\s*=.*?\s(?:copy|slice)-done\(%([\w.\-]+)\)", entry.group(0), re.M):
        if m.group(2) in copies:
            done[m.group(2)] = order.get(m.group(1))
    ops = [(order[k.hlo_name], k.modeled_s, k.hbm_bytes) for k in kernels if k.hlo_name in order]
    ops += [(order[x.name], x.modeled_s, x.bytes_moved or 0) for x in xla_ops if x.name in order]
    windows = sorted((order.get(n, 0), done.get(n) or order.get(n, 0), n) for n in copies)
    groups: list[list] = []  # [start, end, copy names]
    for start, end, n in windows:
        if groups and start <= groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], end)
            groups[-1][2].append(n)
        else:
            groups.append([start, end, [n]])
    out = []
    for start, end, names in groups:
        inside = [(t, b) for i, t, b in ops if start < i < end]
        op_s = sum(t for t, _ in inside)
        copy_bytes = sum(copies[n] for n in names)
        # XLA's pipelines read and write at one efficiency: the bytes' direction does not matter here
        extra = max(0.0, float(chip.stream_s(sum(b for _, b in inside) + copy_bytes)) - op_s)
        out += [XlaOpModel(label, n, 0, extra * copies[n] / copy_bytes, "bytes_moved", copies[n]) for n in names]
    return out


_SCATTER_RE = re.compile(r"=\s*\S+\s+scatter\(%[\w.\-]+,\s*%([\w.\-]+),\s*%([\w.\-]+)\).*?index_vector_dim=(\d+)", re.M)
# The smallest update window charged by its rows: the chip's points scatter rows of 1-4 KiB; XLA's scatters of single
# elements (MoE routing's inverse permutations) are not measured, and keep XLA's estimate.
SCATTER_ROW_MIN_BYTES = 512


def _top_level_ops_holding(hlo: str, op: str):
    """(name, scope, lines) of each top-level instruction that is an `op` (scope: the entry computation; lines: its
    own) or a fusion whose computation holds some (scope: that computation; lines: those instructions)."""
    computations = {m.group(1): m.group(0) for m in _COMPUTATION_RE.finditer(hlo)}
    entry = re.search(r"^ENTRY .*?^\}", hlo, re.M | re.S)
    entry_text = entry.group(0) if entry else ""
    for m in _INSTRUCTION_RE.finditer(entry_text):
        called = re.search(r"calls=%([\w.\-]+)", m.group(2))
        if f" {op}(" in " " + m.group(2).split(", metadata=")[0]:
            yield m.group(1), entry_text, [m.group(0)]
        elif called and f" {op}(" in computations.get(called.group(1), ""):
            scope = computations[called.group(1)]
            yield m.group(1), scope, [line for line in scope.splitlines() if f" {op}(" in line]


def scatter_rows(hlo: str) -> dict[str, int]:
    """{top-level op: rows it scatters} for each scatter of the program, fused or not, whose update windows (one per
    index: the indices' elements over the index vector's) are rows of `SCATTER_ROW_MIN_BYTES` or more."""
    out = {}
    for name, scope, lines in _top_level_ops_holding(hlo, "scatter"):
        rows = 0
        for line in lines:
            found = _SCATTER_RE.search(line)
            shapes = found and [re.search(rf"%{re.escape(found.group(i))} = (\w+)\[([\d,]*)\]", scope) for i in (1, 2)]
            if not shapes or not all(shapes):
                continue
            dims = [int(d) for d in shapes[0].group(2).split(",") if d]
            vector = int(found.group(3))
            count = math.prod(dims) // (dims[vector] if vector < len(dims) else 1)
            updates = _type_bytes(shapes[1].group(1), shapes[1].group(2)) or 0
            if count and updates // count >= SCATTER_ROW_MIN_BYTES:
                rows += count
        if rows:
            out[name] = rows
    return out


_GATHER_RE = re.compile(r"=\s*(\w+)\[([\d,]*)\]\{[^}]*\}\s+gather\(%([\w.\-]+),.*?slice_sizes=\{([\d,]*)\}")


def gather_rows(hlo: str) -> dict[str, tuple[int, int, int]]:
    """{top-level op: (rows it gathers, their bytes, the bytes it writes to HBM)} for each gather of the program,
    fused or not, whose windows (one per index) are rows of `SCATTER_ROW_MIN_BYTES` or more made of whole tiles: the
    operand's two minor dimensions entire (a paged cache's pages, [page, heads, head_dim] each). A window of part of a
    tile (a row of a 2-D array: MoE routing's token rows) is gathered by vector loads, not a DMA a row, and is left
    out. The rows are written once, where the op's result lies in HBM."""
    out = {}
    types = None
    for name, scope, lines in _top_level_ops_holding(hlo, "gather"):
        rows = nbytes = 0
        for line in lines:
            found = _GATHER_RE.search(line)
            gathered = found and _type_bytes(found.group(1), found.group(2))
            if not gathered:
                continue
            source = re.search(rf"%{re.escape(found.group(3))} = (\w+)\[([\d,]*)\]", scope)
            dims = [int(d) for d in source.group(2).split(",") if d] if source else []
            sizes = [int(d) for d in found.group(4).split(",") if d]
            if len(dims) < 2 or sizes[-2:] != dims[-2:]:
                continue  # part of a tile a window: vector loads
            elements = math.prod(int(d) for d in found.group(2).split(",") if d)
            window = math.prod(sizes)
            if window and gathered // elements * window >= SCATTER_ROW_MIN_BYTES:
                rows += elements // window
                nbytes += gathered
        if rows:
            if types is None:
                entry = re.search(r"^ENTRY .*?^\}", hlo, re.M | re.S)
                types = _entry_result_types(entry.group(0) if entry else "")
            out[name] = (rows, nbytes, nbytes if _hbm_bytes(types.get(name, "")) else 0)
    return out


def _type_bytes(dtype: str, dims: str) -> int | None:
    bits = re.fullmatch(r"(?:bf|f|s|u|c)(\d+)(?:e\d+m\d+\w*)?|(pred)", dtype)
    if bits is None:
        return None
    itemsize = 1 if bits.group(2) else max(1, int(bits.group(1)) // 8)  # HLO types: bf16, f32, s8, pred...
    return int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * itemsize


_NO_ESTIMATE_CYCLES = 2**62
_EST_RE = re.compile(r'^\s*(?:ROOT\s+)?%(\S+)\s*=.*"estimated_cycles":"(\d+)"', re.M)


def xla_op_estimates(hlo: str) -> list[tuple[str, int]]:
    """(instruction, estimated_cycles) for each XLA op that carries an estimate."""
    return [(m.group(1), int(m.group(2))) for m in _EST_RE.finditer(hlo)]


_COPY_RE = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(\w+)\[([\d,]*)\]\{[^}]*\}\s+(?:copy|transpose)\(", re.M)


def layout_copies(hlo: str) -> dict[str, int]:
    """{instruction: bytes read + written} for each top-level copy / transpose: a change of layout (XLA picks a
    layout per array; handing an array to a kernel in another one costs a copy). XLA's cycle estimate for these is
    several times what they take (a 268 MB relayout estimated at 1.50 ms on v6e, 2 x 268 MB / 1.64 TB/s = 0.33 ms;
    0.31 ms was measured between two layouts of one weight), so the model costs them by the bytes they move."""
    out = {}
    entry = re.search(r"^ENTRY .*?^\}", hlo, re.M | re.S)  # top-level ops only (fused computations hold copies too)
    for m in _COPY_RE.finditer(entry.group(0) if entry else hlo):
        dims = [int(d) for d in m.group(3).split(",") if d]
        bits = re.fullmatch(r"(?:bf|f|s|u|c)(\d+)(?:e\d+m\d+\w*)?|(pred)", m.group(2))
        if bits is None:
            continue
        itemsize = 1 if bits.group(2) else max(1, int(bits.group(1)) // 8)  # HLO types: bf16, f32, s8, pred...
        out[m.group(1)] = 2 * int(np.prod(dims, dtype=np.int64)) * itemsize
    return out


# --------------------------------------------------------------------------- model


def _mxu_macs(op: str, mxu: int) -> int:
    rows = 8
    if ".bf16" in op or "packed" in op:
        rows = 16
    if any(t in op for t in (".s8", ".u8", ".f8", "e4m3", "e5m2", "x8")):
        rows = 32
    return rows * mxu * mxu


_ITERATION_BOUNDS_RE = re.compile(r"iteration_bounds = array<i64(?::\s*([-\d,\s]*))?>")
_SCF_FOR_BOUND_RE = re.compile(r"scf\.for %[\w#]+ = %[\w#]+ to (%[\w#]+)")
_CONSTANT_RE = re.compile(r"(%[\w#]+) = arith\.constant")


def body_grid(body: str) -> tuple | None:
    """A Mosaic kernel's grid from its body: the iteration bounds, None for a dimension sized at run time (Mosaic
    writes INT64_MIN); () for a kernel with no grid; None when there is no body to read."""
    if not body:
        return None
    m = _ITERATION_BOUNDS_RE.search(body)
    if m is None:
        return ()
    dims = [int(d) for d in (m.group(1) or "").split(",") if d.strip()]
    return tuple(d if d >= 0 else None for d in dims)


def body_has_runtime_loops(body: str) -> bool:
    """Whether a Mosaic kernel's body holds loops sized at run time (a while loop, or a for loop to a computed
    bound): their trip counts are not in the schedule."""
    if "scf.while" in body:
        return True
    constants = set(_CONSTANT_RE.findall(body))
    return any(bound not in constants for bound in _SCF_FOR_BOUND_RE.findall(body))


def _schedule_traffic(sched: B.KernelSchedule, steps: int, grid_known: bool, select):
    """HBM bytes of the schedule's DMAs that `select` picks: (in per step, out per step, DMAs per step, bound). A DMA
    before the grid
    loop is charged to the first step, one after it to the last, one in it to every step, times the trips of the inner
    loops around it. Lower bound when a DMA cannot be sized or sits in a loop of unknown trips (counted once); upper
    bound when one is predicated (counted as always issued)."""
    reads, writes = np.zeros(steps), np.zeros(steps)
    dmas = np.zeros(steps)  # DMAs per step (each one descriptor, one run: these copy whole SMEM operands)
    lower = upper = False
    for d in sched.dmas:
        if not d.touches_hbm or not select(d):
            continue
        repeats = sched.dma_repeats(d)
        section = sched.dma_section(d)
        lower |= d.nbytes is None or repeats is None or (section == "body" and not grid_known)
        upper |= d.predicated
        nbytes = (d.nbytes or 0) * (repeats or 1)
        at = {"prologue": slice(0, 1), "epilogue": slice(steps - 1, steps), "body": slice(None)}[section]
        if d.source == "hbm":
            reads[at] += nbytes
        if d.dest == "hbm":
            writes[at] += nbytes
        dmas[at] += repeats or 1
    return reads, writes, dmas, _bound(lower, upper)


def _loop_constructs(info, sched: B.KernelSchedule) -> dict[int, object]:
    """{index in sched.inner_loops: the kernel_eval Construct of that loop}, matched level by level: the loops directly
    inside a matched loop (or at the top) pair up in order when the schedule and the kernel's jaxpr have as many
    there; a level whose counts differ (the compiler added or unrolled a loop) is left unmatched, and so is what is
    inside it."""
    if info is None or info.evaluated is None or not sched.inner_loops:
        return {}
    constructs = info.evaluated.constructs
    loops = sched.inner_loops

    def sched_children(parent):
        def inside(i, j):  # loop i inside loop j
            return j != i and loops[j][0] <= loops[i][0] and loops[i][1] <= loops[j][1]

        out = []
        for i in range(len(loops)):
            around = [j for j in range(len(loops)) if inside(i, j)]
            innermost = min(around, key=lambda j: loops[j][1] - loops[j][0]) if around else None
            if innermost == parent:
                out.append(i)
        return sorted(out, key=lambda i: loops[i][0])

    def jaxpr_children(parent):
        if parent is None:
            return [c for c in constructs if c.kind == "loop" and c.depth == 0]
        at = next(k for k, c in enumerate(constructs) if c is parent)
        out = []
        for c in constructs[at + 1 :]:
            if c.depth <= parent.depth:
                break
            if c.kind == "loop" and c.depth == parent.depth + 1:
                out.append(c)
        return out

    matched = {}

    def match(sched_parent, jaxpr_parent):
        mine, theirs = sched_children(sched_parent), jaxpr_children(jaxpr_parent)
        if len(mine) != len(theirs):
            return
        for i, c in zip(mine, theirs):
            matched[i] = c
            match(i, c)

    match(None, None)
    return matched


def _region_constructs(info, sched: B.KernelSchedule, loops: dict) -> dict[int, object]:
    """{index in sched.loop_regions: the Construct of that region}, per matched loop: the schedule's branches inside
    the loop and the kernel's regions inside it that do vector work (the compiler predicates scalar-only ones), in
    order, when their counts agree."""
    constructs = info.evaluated.constructs if info is not None and info.evaluated is not None else []
    out = {}
    for i, loop in loops.items():
        at = next(k for k, c in enumerate(constructs) if c is loop)
        inside = []
        for c in constructs[at + 1 :]:
            if c.depth <= loop.depth:
                break
            if c.kind == "region" and c.depth == loop.depth + 1 and c.vector_work:
                inside.append(c)
        mine = [k for k, (li, _) in enumerate(sched.loop_regions) if li == i]
        out.update(_align_regions(sched, mine, inside))
    return out


def _align_regions(sched: B.KernelSchedule, mine: list[int], theirs: list) -> dict[int, object]:
    """Pair the kernel's regions (`theirs`, program order) with schedule branches (`mine`, address order), in order,
    every one of theirs paired, a branch with matmuls (vmatmul in it) only with a region with matmuls, one around a
    loop only with one around a loop, and the other way round; schedule branches left over are the compiler's own (an
    edge-tile path, a guard around a loop the kernel does not branch over). The pairing with the most matmul regions
    paired wins, then the one pairing each region with its earliest candidate; none when no pairing is consistent."""
    n, m = len(theirs), len(mine)
    if n == 0 or n > m:
        return {}
    mxu = [addr for addr, _ in sched.mxu_ops_body]
    kinds = []
    for k in mine:
        r = sched.loop_regions[k][1]
        kinds.append(
            (
                any(r.branch_addr < a < r.target for a in mxu),
                any(r.branch_addr < t < r.target for t, _, _ in sched.inner_loops),
            )
        )
    has_mxu = [k[0] for k in kinds]
    neg = float("-inf")
    # best[j][i]: best score pairing theirs[:j] within mine[:i]
    best = [[0.0] * (m + 1)] + [[neg] * (m + 1) for _ in range(n)]
    for j in range(1, n + 1):
        for i in range(1, m + 1):
            skip = best[j][i - 1]
            pair = neg
            if kinds[i - 1] == (theirs[j - 1].dots, theirs[j - 1].loops) and best[j - 1][i - 1] > neg:
                pair = best[j - 1][i - 1] + (2.0 if has_mxu[i - 1] else 1.0)
            best[j][i] = max(skip, pair)
    if best[n][m] == neg:
        return {}
    out, j, i = {}, n, m
    while j > 0:
        if best[j][i] == best[j][i - 1]:
            i -= 1
            continue
        out[mine[i - 1]] = theirs[j - 1]
        i, j = i - 1, j - 1
    return out


def _loop_cycles(sched: B.KernelSchedule, info, skip: np.ndarray) -> tuple[np.ndarray | None, list[str]]:
    """Cycles per step to add to the schedule's count, which runs each loop's body its static trips (once when sized
    at run time) and each branch inside a loop at every iteration, from the kernel's evaluation: a run-time loop's
    (iterations - once) x its bundles; a branch's (runs - runs of what encloses it) x its bundles. Nothing where a grid
    region around the loop is skipped at that step (its bundles are taken out with the region). None when nothing
    could be matched."""
    loops = _loop_constructs(info, sched)
    if not loops:
        return None, []
    steps = skip.shape[0]
    extra = np.zeros(steps)
    notes = []

    def skipped_at(addr):
        around = [k for k, r in enumerate(sched.conds) if r.branch_addr < addr < r.target]
        return skip[:, around].any(axis=1) if around else np.zeros(steps, bool)

    runtime = 0
    for i, loop in loops.items():
        t, e, trip = sched.inner_loops[i]
        if trip is not None or loop.executions is None:
            continue
        once = 1
        for t2, e2, trip2 in sched.inner_loops:
            if trip2 is not None and t2 <= t < e2 and (t2, e2) != (t, e):
                once *= trip2
        extra += np.where(skipped_at(t), 0.0, (e - t) * (np.asarray(loop.executions, np.float64) - once))
        runtime += 1
    if runtime:
        notes.append(f"the trips of {runtime} loop(s) sized at run time come from evaluating the kernel on the inputs")
    regions = _region_constructs(info, sched, loops)
    for k, rc in regions.items():
        i, r = sched.loop_regions[k]
        loop = loops.get(i)
        if rc.executions is None or loop is None or loop.executions is None:
            continue
        parent = loop.executions
        for k2, rc2 in regions.items():  # the innermost matched region around this one
            i2, r2 = sched.loop_regions[k2]
            if k2 != k and i2 == i and r2.branch_addr < r.branch_addr and r.target <= r2.target:
                parent = rc2.executions if rc2.executions is not None else parent
        extra += np.where(skipped_at(r.branch_addr), 0.0, r.skipped * (rc.executions - parent))
    unmatched = len(sched.loop_regions) - len(regions)
    if regions:
        notes.append(f"{len(regions)} branch(es) inside loops charged where they run (from the kernel's evaluation)")
    if unmatched:
        notes.append(f"{unmatched} branch(es) inside loops not matched to the kernel's code: counted as run")
    return extra, notes


def _pair_grid_regions(evaluated, sched: B.KernelSchedule):
    """Pair the kernel's grid-level regions with the schedule's branch regions when their counts differ: regions whose
    code is scalar work and DMA starts/waits only (`Construct.predicable`) may have been if-converted (predicated
    instructions, no branch), and the pipeline's write-back into an output in VMEM is a branch of its own
    (`KernelSchedule.output_copies`), with the compiler's branches inside it. Tried in order: the predicable regions
    with no conditional in them set aside (their parent stays a branch), then every predicable region; the schedule
    with its output copies, without them, then without them and the branches inside them. The
    first combination whose counts agree, with every pair agreeing on matmuls (a region with a matmul in its code and
    a branch with a vmatmul in it), pairs in program order. Returns ({schedule index: kernel index}, kernel regions
    set aside, schedule branches left unpaired), or None."""
    if evaluated is None or len(evaluated.cond_regions) != len(evaluated.conds):
        return None
    regions = evaluated.cond_regions
    everything = list(range(len(regions)))
    kernel_sets = [
        everything,
        [i for i, r in enumerate(regions) if not (r.predicable and not r.nests)],
        [i for i, r in enumerate(regions) if not r.predicable],
    ]
    branches = list(range(len(sched.conds)))
    # An output copy's own branches (a partial block's masked rows, its loops) are inside it: the pipeline's as well.
    copies = [
        k
        for k in branches
        if any(
            sched.conds[c].branch_addr <= sched.conds[k].branch_addr and sched.conds[k].target <= sched.conds[c].target
            for c in sched.output_copies
        )
    ]
    sched_sets = [branches]
    if sched.output_copies:
        sched_sets.append([k for k in branches if k not in sched.output_copies])
    if len(copies) > len(sched.output_copies):
        sched_sets.append([k for k in branches if k not in copies])
    mxu = [addr for addr, _ in sched.mxu_ops_body]

    def has_mxu(k):
        r = sched.conds[k]
        return any(r.branch_addr < a < r.target for a in mxu)

    for kept in kernel_sets:
        for used in sched_sets:
            if len(kept) != len(used) or (kept is everything and used is branches):
                continue
            if all(regions[i].dots_within == has_mxu(k) for i, k in zip(kept, used)):
                return dict(zip(used, kept)), len(regions) - len(kept), len(branches) - len(used)
    return None


def _bound(lower: bool, upper: bool) -> str:
    return "approximate" if lower and upper else "lower" if lower else "upper" if upper else "exact"


def _model_kernel(
    chip: C.Chip,
    hlo_name: str,
    files: dict,
    info: T.PallasCallInfo | None,
    label: str,
    body: str = "",
    *,
    xla_op: bool = False,
    runtime_traffic: tuple | None = None,
) -> KernelModel:
    """A Mosaic kernel's time from its schedule and DMAs; with `xla_op`, an XLA op's (its own LLO schedule: no
    pallas_call, no Mosaic body, no kernel launch). runtime_traffic: for a kernel XLA emits itself whose grid is sized
    at run time, its per-step (input bytes, output bytes, input DMAs, output DMAs) where the program's inputs decide
    them (xla_ragged_dot.step_traffic)."""
    warnings: list[str] = []
    notes: list[str] = []
    pre = files.get(f"{hlo_name}/pre_delay")
    final = files.get(f"{hlo_name}/final")
    if pre is None and final is None:
        raise RuntimeError(f"no bundle dump found for kernel {hlo_name}")
    if pre is None:
        warnings.append("pre-delay schedule missing: using final bundles (undercounts MXU waits)")
        pre = final
    grid_of_body = body_grid(body)
    if info is not None:
        has_grid = bool(info.grid)
    else:
        has_grid = grid_of_body is None or bool(grid_of_body)
    sched = B.analyze(B.parse_bundles(pre), has_grid=has_grid)
    warnings += sched.warnings
    final_sum = B.final_schedule_summary(final) if final else {}
    # The Mosaic body says whether loops are sized at run time when it is MLIR text (XLA's own kernels); a
    # pallas_call's jaxpr says it for kernels whose body is serialized as bytecode (tokamax's).
    runtime_loops = body_has_runtime_loops(body) or (info is not None and info.runtime_loops)
    unsized_matched = {i for i, _ in _loop_constructs(info, sched).items() if sched.inner_loops[i][2] is None}
    manual_in = manual_out = manual_dmas = manual_runs = np.zeros(1)
    manual_bound = "exact"
    if sched.unsized_loops and len(unsized_matched) < len(sched.unsized_loops):
        what = f"{len(sched.unsized_loops)} inner loop(s) at {', '.join(hex(a) for a in sched.unsized_loops)}"
        if runtime_loops:
            notes.append(
                "inner loops with a trip count decided at run time are counted once each (compute and the DMAs "
                "inside them are lower bounds)"
            )
        else:
            warnings.append(f"{what}: trip count not found in the schedule, each counted once")

    trip = sched.trip_count
    runtime_grid = grid_of_body is not None and any(d is None for d in grid_of_body)
    grid_known = info is not None or runtime_traffic is not None or not (sched.has_loop and not sched.trip_count_static)
    if not grid_known:
        if runtime_grid:
            notes.append(
                "grid sized at run time, and no pallas_call in the program gives its size: one grid step counted "
                "(compute and HBM bytes are lower bounds)"
            )
        else:
            warnings.append(
                "grid loop bound not found in the schedule and no pallas_call to take it from: trip count assumed 1"
            )
    if info is not None:
        steps = info.steps
        if sched.has_loop and not sched.trip_count_static:
            trip = steps + 2  # dynamic grid: the steps come from the concrete inputs, plus the pipeline's two stages
        in_b, out_b = info.in_bytes.astype(np.float64), info.out_bytes.astype(np.float64)
        in_d, out_d = info.in_dmas.astype(np.float64), info.out_dmas.astype(np.float64)
        in_r, out_r = info.in_runs.astype(np.float64), info.out_runs.astype(np.float64)
        conds = info.cond_taken
        if sched.has_loop and trip - steps not in (0, 1, 2, 3):
            warnings.append(f"grid has {steps} steps but the loop runs {trip} iterations")
        if len(conds) == len(sched.conds):
            skip = np.zeros((steps, len(conds)), bool)
            for i, t in enumerate(conds):
                if t is not None:
                    skip[:, i] = ~t
        elif not info.grid:
            # One step and nothing to skip by program id: every region counts as run (an upper bound on that step).
            notes.append(f"no grid: its {len(sched.conds)} conditional region(s) in the schedule counted as run")
            skip = np.zeros((steps, len(sched.conds)), bool)
        elif not conds:
            # No pl.when to map them to: the compiler's own branches (e.g. a partial edge block when the block does
            # not divide the array), which run on some steps only; counted on all (an upper bound on compute).
            notes.append(
                "conditional regions the compiler made (no pl.when in the kernel) counted as run on every step"
            )
            skip = np.zeros((steps, len(sched.conds)), bool)
        else:
            skip = np.zeros((steps, len(sched.conds)), bool)
            paired = _pair_grid_regions(info.evaluated, sched)
            if paired is None:
                warnings.append(
                    f"{len(conds)} pl.when/cond in the kernel vs {len(sched.conds)} branch "
                    "regions in the schedule: every region modeled as run on every step"
                )
            else:
                pairs, predicated, copies = paired
                for k, i in pairs.items():
                    if conds[i] is not None:
                        skip[:, k] = ~conds[i]
                if predicated:
                    notes.append(
                        f"{predicated} of the kernel's {len(conds)} conditional regions hold only scalar work and DMA "
                        "starts/waits and have no branch in the schedule (the compiler predicates them): their "
                        "instructions are in the code around them, counted where it runs"
                    )
                if copies:
                    notes.append(
                        f"{copies} branch(es) of the pipeline writing output blocks into an output XLA placed in VMEM "
                        "counted as run on every step"
                    )
        dot_flops = float(info.dot_flops_per_step.sum())
        warnings += info.warnings
        grid = info.grid
        blocks = [dataclasses.asdict(b) for b in info.blocks]
        jaxpr_bound = "exact" if all(b.exact for b in info.blocks if b.memory_space == "vmem") else "upper"
        # SMEM operands and scalar prefetch are copied in before the body and out after it by DMA instructions of the
        # schedule, counted there. The kernel's own DMAs (make_async_copy, emit_pipeline) are counted from its jaxpr
        # (kernel_eval: each dma_start with its slice's bytes, at every iteration of the loops around it).
        select = lambda d: "smem" in (d.source, d.dest)  # noqa: E731
        evaluated = info.evaluated
        if evaluated is not None:
            manual_in, manual_out = evaluated.dma_in, evaluated.dma_out
            manual_dmas, manual_runs = evaluated.dma_count, evaluated.dma_runs
            manual_bound = _bound(evaluated.dmas_lower, evaluated.dmas_upper)
            if evaluated.extrapolated:
                manual_bound = "approximate"
                notes.append(
                    "a loop too long to evaluate whole (a pipeline of many steps) was evaluated for a sample of its "
                    "iterations, scaled to its trip count: its DMAs, branches and steps are an estimate"
                )
            if evaluated.remote_bytes.any():
                notes.append(
                    f"{int(evaluated.remote_bytes.sum())} bytes of DMAs to other devices (ICI) not timed: the model "
                    "has one core"
                )
        elif any(b.memory_space == "any" for b in info.blocks):
            warnings.append("kernel control flow not evaluated: its manual DMAs are not counted")
            manual_bound = "lower"
    elif runtime_traffic is not None:
        # XLA's own kernel with its grid from the group sizes: the steps and their blocks' DMAs as a pallas_call's
        in_b, out_b, in_d, out_d = (np.asarray(a, np.float64) for a in runtime_traffic)
        steps = len(in_b)
        if sched.has_loop and not sched.trip_count_static:
            trip = steps + 2
        in_r, out_r = in_d.copy(), out_d.copy()
        skip = np.zeros((steps, len(sched.conds)), bool)
        n_tiles, k_tiles = grid_of_body[0], grid_of_body[2]
        dot_flops, grid, blocks = 0.0, (n_tiles, steps // (n_tiles * k_tiles), k_tiles), []
        jaxpr_bound = "exact"
        notes.append(
            f"XLA's ragged dot kernel: {steps} grid steps from the program's group sizes, its blocks fetched as a "
            "pallas_call's (xla_ragged_dot.py)"
        )
        # its pipeline's DMAs are in the schedule too, issued every step: the blocks above count them
        select = lambda d: "smem" in (d.source, d.dest)  # noqa: E731
    else:
        steps = max(1, trip - 2) if sched.has_loop and sched.trip_count_static else 1
        in_b = np.zeros(steps)
        out_b = np.zeros(steps)
        in_d, out_d, in_r, out_r = (np.zeros(steps) for _ in range(4))
        skip = np.zeros((steps, len(sched.conds)), bool)
        dot_flops, grid, blocks = 0.0, grid_of_body or (), []
        jaxpr_bound = "exact"
        if not xla_op:
            notes.append(
                "a Mosaic kernel with no pallas_call in the program (XLA emits some itself, e.g. for lax.ragged_dot): "
                "its HBM bytes are the DMAs of its schedule"
            )
        select = lambda d: True  # noqa: E731
    sched_in, sched_out, sched_dmas, sched_bound = _schedule_traffic(sched, steps, grid_known, select)
    in_b, out_b = in_b + sched_in, out_b + sched_out
    # The schedule's DMAs are charged as inputs of their step (SMEM copies: before the body, after it, or in it).
    in_d, in_r = in_d + sched_dmas, in_r + sched_dmas
    hbm_from_schedule = int(sched_in.sum() + sched_out.sum())
    bounds = {jaxpr_bound, sched_bound, manual_bound} - {"exact"}
    hbm_bytes_bound = _bound(bool(bounds & {"lower", "approximate"}), bool(bounds & {"upper", "approximate"}))

    # Cycles per step from the skip pattern (distinct patterns only).
    region_sizes = np.array([r.skipped for r in sched.conds], np.int64)
    step_cycles = (
        sched.body - (skip * region_sizes[None, :]).sum(axis=1)
        if len(region_sizes)
        else np.full(steps, sched.body, np.int64)
    )
    loop_extra, loop_notes = _loop_cycles(sched, info, skip)
    if loop_extra is not None:
        step_cycles = step_cycles + loop_extra
    notes += loop_notes
    # MXU ops per step
    patterns, inv = (
        np.unique(skip, axis=0, return_inverse=True) if skip.size else (np.zeros((1, 0), bool), np.zeros(steps, int))
    )
    inv = np.asarray(inv).reshape(-1)
    ops_per_pattern = [sched.mxu_ops_in(list(p)) if len(p) else sched.mxu_ops_in(None) for p in patterns]
    macs_per_pattern = np.array([sum(_mxu_macs(o, chip.mxu_size) for o in ops) for ops in ops_per_pattern])
    nops_per_pattern = np.array([len(ops) for ops in ops_per_pattern])
    mxu_flops = float(2 * macs_per_pattern[inv].sum()) if steps else 0.0
    mxu_ops_mean = float(nops_per_pattern[inv].mean()) if steps else 0.0

    clk = chip.clock_hz
    compute = step_cycles / clk
    # Pipeline: while step s computes, step s+1's inputs arrive and step s-1's outputs leave. The kernel's own DMAs
    # are issued within the step and overlap its compute (they are asynchronous; emit_pipeline double-buffers them).
    # Reads and writes run at their own bandwidths (chips.Calibration.hbm_read_efficiency / _write_). Each DMA also
    # costs DMA-engine time by its shape (chips.Calibration.dma_descriptor_s per DMA, dma_run_s per contiguous run in
    # HBM beyond its first), on the DMA side of the step: it overlaps compute as the bytes do.
    dma_in, dma_out, descriptors, runs = np.zeros(steps), np.zeros(steps), np.zeros(steps), np.zeros(steps)
    if steps > 1:
        dma_in[:-1] += in_b[1:]
        dma_out[1:] += out_b[:-1]
        descriptors[:-1] += in_d[1:]
        descriptors[1:] += out_d[:-1]
        runs[:-1] += in_r[1:]
        runs[1:] += out_r[:-1]
    if steps:
        dma_in = dma_in + np.broadcast_to(manual_in, (steps,))
        dma_out = dma_out + np.broadcast_to(manual_out, (steps,))
    descriptors = descriptors + (np.broadcast_to(manual_dmas, (steps,)) if steps else 0.0)
    runs = runs + (np.broadcast_to(manual_runs, (steps,)) if steps else 0.0)
    shape_t = chip.dma_shape_s(descriptors, runs)
    dma_t = chip.stream_s(dma_in, dma_out) + shape_t
    per_step = np.maximum(compute, dma_t)
    n_fill = max(0, trip - steps) if sched.has_loop else 0
    fixed_cycles = sched.prologue + sched.epilogue + n_fill * sched.fill_cycles()
    # Every pipeline step (grid steps with the fill/drain iterations, and the iterations of the kernel's own DMA
    # loops) pays the chip's per-step cost on top of its cycles and DMA time.
    pipeline_steps = (steps + n_fill) if sched.has_loop else 0
    if info is not None and info.evaluated is not None:
        pipeline_steps += float(info.evaluated.pipeline_steps.sum())
        one_way = float(info.evaluated.one_way_iterations.sum())
        if one_way:
            notes.append(
                f"{one_way:.0f} iterations of loops that only start DMAs or only wait on them (a batch issued, then "
                "drained): charged their cycles and their DMAs' time, not a pipeline step's cost each"
            )
    step_overhead_s = pipeline_steps * chip.step_overhead_s
    # The first step's inputs, the last one's outputs.
    end_d, end_r = (in_d[0] + out_d[-1], in_r[0] + out_r[-1]) if steps else (0.0, 0.0)
    end_shape_s = float(chip.dma_shape_s(end_d, end_r))
    ends_s = (float(chip.stream_s(in_b[0], out_b[-1])) if steps else 0.0) + end_shape_s
    descriptors_total = float(descriptors.sum() + end_d)
    runs_total = float(runs.sum() + end_r)
    shape_total_s = float(shape_t.sum()) + end_shape_s
    launch_s = 0.0 if xla_op else chip.launch_overhead_s
    total = ends_s + per_step.sum() + fixed_cycles / clk + step_overhead_s + launch_s
    in_b = in_b + np.broadcast_to(manual_in, in_b.shape)  # the totals count both the pipeline's and the kernel's DMAs
    out_b = out_b + np.broadcast_to(manual_out, out_b.shape)
    hbm_bytes = int(in_b.sum() + out_b.sum())
    bound = "compute" if compute.sum() >= dma_t.sum() + ends_s else "hbm"
    return KernelModel(
        label=label,
        hlo_name=hlo_name,
        kernel_name=info.name if info else hlo_name,
        grid=tuple(grid),
        steps=int(steps),
        trip_count=int(trip),
        prologue_bundles=sched.prologue,
        epilogue_bundles=sched.epilogue,
        loop_body_bundles=sched.body,
        step_cycles_min=int(step_cycles.min()),
        step_cycles_max=int(step_cycles.max()),
        step_cycles_mean=float(step_cycles.mean()),
        fill_iteration_cycles=sched.fill_cycles(),
        final_bundles=final_sum,
        mxu_ops_per_step=mxu_ops_mean,
        mxu_flops=mxu_flops,
        dot_flops=dot_flops,
        dma_instructions_per_iteration=len(sched.dmas_body),
        hbm_bytes=hbm_bytes,
        hbm_bytes_in=int(in_b.sum()),
        hbm_bytes_out=int(out_b.sum()),
        hbm_bytes_bound=hbm_bytes_bound,
        hbm_bytes_from_schedule=hbm_from_schedule,
        dma_descriptors=descriptors_total,
        dma_runs=runs_total,
        dma_shape_s=shape_total_s,
        blocks=blocks,
        compute_s=float(compute.sum() + fixed_cycles / clk),
        hbm_s=float(chip.stream_s(in_b.sum(), out_b.sum())),
        pipeline_steps=float(pipeline_steps),
        step_overhead_s=float(step_overhead_s),
        modeled_s=float(total),
        bound=bound,
        warnings=warnings,
        notes=notes,
    )


@functools.cache
def _topology_device(topology: str):
    """A deviceless device of `topology` (None if libtpu cannot describe it). Tracing under it as default device
    makes kernels that tune by chip (pltpu.get_tpu_info()) trace for the generation being compiled for, not for
    the host; otherwise the traffic would be counted for other block sizes than the compiled kernel's."""
    try:
        from jax.experimental import topologies

        return topologies.get_topology_desc(topology, "tpu").devices[0]
    except Exception:  # noqa: BLE001 - no libtpu: trace for the host's default
        return None


def trace_device(gen: str):
    """The deviceless device of `gen`'s topology (None without libtpu): under `jax.default_device` of it, code that
    asks which chip it runs on (tuning tables) answers for `gen`, as the model's own traces do."""
    return _topology_device(C.get_chip(C.canonical_gen(gen)).topology)


def _prepare(fn, args, chip):
    return T.analyze_pallas_calls(fn, tuple(args), trace_device=_topology_device(chip.topology))


def model_function(fn, args, gen: str = "v6e", *, keep_dumps: str | None = None) -> ProgramModel:
    """Model the run time of jax.jit(fn)(*args) on one TensorCore of TPU generation `gen`.

    fn:   a jit-able function, picklable by reference (module-level function or a
          functools.partial of one; static configuration goes into the partial).
    args: tuple of positional arguments: concrete arrays (preferred: scalar-prefetch
          values and data-dependent block indices are then exact) or
          jax.ShapeDtypeStruct (pytrees of them allowed), or a mix (e.g. concrete
          group sizes beside ShapeDtypeStruct matrices: what only the former decide is exact).
    gen:  "v5e", "v6e" or "v7x".
    keep_dumps: optional directory to copy the compiler dumps to.

    Returns a ProgramModel; every time in it is labeled "modeled <gen>".
    """
    gen = C.canonical_gen(gen)
    chip = C.get_chip(gen)
    args = tuple(args)
    infos, warnings, ragged_dots = _prepare(fn, args, chip)
    # Always dump: XLA emits Mosaic kernels of its own for some ops (lax.ragged_dot), which are modeled from bundles.
    compiled = compile_deviceless(fn, args, gen, dump=True, keep_dumps=keep_dumps)
    return _assemble(chip, infos, warnings, compiled, ragged_dots)


def model_functions(items, gen: str = "v6e") -> list:
    """Model several (fn, args) at once: like `model_function` for each, but the compiles share one subprocess.
    Returns, per item, a ProgramModel or the Exception modeling it raised."""
    gen = C.canonical_gen(gen)
    chip = C.get_chip(gen)
    results: list = [None] * len(items)
    prepared = {}
    for i, (fn, args) in enumerate(items):
        try:
            prepared[i] = _prepare(fn, tuple(args), chip)
        except Exception as e:  # noqa: BLE001
            results[i] = e
    # Dumps for every program: XLA itself emits Mosaic kernels for some ops (e.g. lax.ragged_dot on TPU), and those
    # are modeled from their bundles like a pallas_call (their HBM bytes are unknown: see KernelModel.warnings).
    idx = list(prepared)
    if idx:
        compiled = compile_deviceless_many([(items[i][0], tuple(items[i][1])) for i in idx], gen, dump=True)
        for i, c in zip(idx, compiled):
            if isinstance(c, Exception):
                results[i] = c
                continue
            try:
                infos, warnings, ragged_dots = prepared[i]
                results[i] = _assemble(chip, infos, warnings, c, ragged_dots)
            except Exception as e:  # noqa: BLE001
                results[i] = e
    return results


_DUMP_KINDS = ("pre_delay", "final", "profile")


def _memory_spaces(hlo: str, hlo_name: str) -> tuple:
    """Where a custom call's result and operands live ("S(n)" in their layouts: VMEM, SMEM; none: HBM), from the HLO."""

    def space(type_text):
        return tuple(re.findall(r"S\((\d+)\)", type_text)) or ("hbm",)

    m = re.search(rf"%{re.escape(hlo_name)} = (.*?) custom-call\(([^)]*)\)", hlo)
    if m is None:
        return ()
    operands = []
    for op in re.findall(r"%([\w.\-]+)", m.group(2)):
        d = re.search(rf"%{re.escape(op)} = (.*?) [a-z][\w\-]*\(", hlo)
        operands.append(space(d.group(1)) if d else ("?",))
    return space(m.group(1)), tuple(operands)


def _share_dumps_of_identical_kernels(calls, files: dict, hlo: str) -> tuple[dict, list[str]]:
    """libtpu compiles a Mosaic kernel once per distinct body and placement of its operands and result (VMEM or HBM)
    and dumps it under one call's name: Gemma 4's layer holds seven RMSNorms of one shape, three of them with their
    operand and result in VMEM like a fourth. A call without a dump of its own takes the dump of the call with the
    same body and placement (the same compiled kernel), else, with a warning, of one with the same body."""
    signature = {name: (body, _memory_spaces(hlo, name)) for name, body in calls}
    dumped = [name for name, _ in calls if any(f"{name}/{kind}" in files for kind in _DUMP_KINDS)]
    shared, warnings = dict(files), []
    for name, body in calls:
        if name in dumped:
            continue
        twins = [t for t in dumped if signature[t] == signature[name]]
        if not twins:
            twins = [t for t in dumped if signature[t][0] == body]
            if twins:
                warnings.append(f"{name}: no dump of its own; modeled from {twins[0]}'s (same body, other placement)")
        for kind in _DUMP_KINDS if twins else ():
            if f"{twins[0]}/{kind}" in files:
                shared[f"{name}/{kind}"] = files[f"{twins[0]}/{kind}"]
    return shared, warnings


_NAME_RE = re.compile(r"%[\w.\-]+|\bparam_\d+(?:\.\d+)?")
_METADATA_RE = re.compile(r", metadata=\{[^}]*\}")


def _xla_op_signature(instruction: str, computations: dict[str, str]) -> str:
    """An XLA op as libtpu compiles it, names and metadata aside: its result type, operands' placement, backend
    config and the body of the computation it calls (whose header carries the operands' types)."""
    called = re.search(r"calls=%([\w.\-]+)", instruction)
    body = computations.get(called.group(1), "") if called else ""
    return _NAME_RE.sub("%", _METADATA_RE.sub("", instruction + "\n" + body))


def _share_dumps_of_identical_xla_ops(hlo: str, files: dict, timed: list[str]) -> dict:
    """libtpu compiles identical XLA ops once and dumps the schedule under one of their names: an fp8 cache's four
    dequantizing fusions (K and V of two layers' pages) left one schedule and three ops costed by XLA's estimate, 2.4x
    the schedule's time. An op of `timed` (those the model times from their schedule) without a dump of its own takes
    its twin's."""
    wanted = [n for n in timed if f"{n}/pre_delay" not in files]
    if not wanted:
        return files
    computations = {m.group(1): m.group(0) for m in _COMPUTATION_RE.finditer(hlo)}
    entry = re.search(r"^ENTRY .*?^\}", hlo, re.M | re.S)
    instructions = {m.group(1): m.group(2) for m in _INSTRUCTION_RE.finditer(entry.group(0) if entry else "")}
    dumped: dict[str, str] = {}
    for name, rest in instructions.items():
        if f"{name}/pre_delay" in files:
            dumped.setdefault(_xla_op_signature(rest, computations), name)
    shared = dict(files)
    for name in wanted:
        twin = dumped.get(_xla_op_signature(instructions[name], computations)) if name in instructions else None
        if twin is not None:
            shared[f"{name}/pre_delay"] = files[f"{twin}/pre_delay"]
    return shared


def _xla_ragged_dot_traffic(body: str, ragged_dots: list) -> tuple | None:
    """The per-step traffic of XLA's ragged-dot kernel (`body`) from the first of the program's ragged dots whose shapes
    it takes and whose group sizes are known (taken off `ragged_dots`); None when none is."""
    kernel = xla_ragged_dot.parse(body)
    if kernel is None:
        return None
    for i, rd in enumerate(ragged_dots):
        (m, k), (groups, _, n) = rd.lhs_shape, rd.rhs_shape
        fits = groups == kernel.groups and kernel.n_tiles == -(-n // kernel.tn) and kernel.k_tiles == -(-k // kernel.tk)
        if fits and kernel.max_tiles == -(-m // kernel.tm) + groups - 1:
            del ragged_dots[i]
            return None if rd.group_sizes is None else xla_ragged_dot.step_traffic(kernel, rd.group_sizes, m, k, n)
    return None


def _assemble(chip, infos, warnings, compiled, ragged_dots=()) -> ProgramModel:
    gen = chip.gen
    label = f"modeled {gen}"
    warnings = list(warnings)
    info_all, files = compiled
    hlo = info_all["hlo"]
    if info_all.get("hlo_source") == "xla_dump":
        warnings.append(
            "compiled.as_text() failed: XLA ops read from XLA's text dump, where most carry no cycle "
            "estimate (those count as 0): XLA time is undercounted"
        )
    calls = _mosaic_calls(hlo)
    # Match HLO custom calls to jaxpr pallas_calls in program order: by the instruction's name (XLA names a Mosaic
    # custom call after its kernel, "<name>.<n>"), else by kernel name in the Mosaic body, else the next one. Names
    # matter: XLA merges identical calls (CSE), so the HLO can hold fewer calls than the jaxpr.
    remaining = list(range(len(infos)))
    kernels = []
    files, shared_warnings = _share_dumps_of_identical_kernels(calls, files, hlo)
    warnings += shared_warnings
    ragged_dots = list(ragged_dots)
    for hlo_name, body in calls:
        match = None
        base = re.sub(r"\.\d+$", "", hlo_name)
        traffic = _xla_ragged_dot_traffic(body, ragged_dots)
        if traffic is not None:  # XLA's own kernel: no pallas_call of the program's is its
            kernels.append(_model_kernel(chip, hlo_name, files, None, label, body=body, runtime_traffic=traffic))
            continue
        for j in remaining:
            if infos[j].name and infos[j].name == base:
                match = j
                break
        for j in remaining if match is None else ():
            if infos[j].name and infos[j].name in body:
                match = j
                break
        if match is None and remaining:
            match = remaining[0]
        if match is not None:
            remaining.remove(match)
        kernels.append(
            _model_kernel(chip, hlo_name, files, infos[match] if match is not None else None, label, body=body)
        )
    mosaic_names = {n for n, _ in calls}
    copies = layout_copies(hlo)
    scheduled = scheduled_xla_ops(hlo)
    matmuls = matmul_ops(hlo)
    files = _share_dumps_of_identical_xla_ops(hlo, files, [*scheduled, *matmuls])
    scheduled = set(scheduled)
    xla_ops = []
    estimated = xla_op_estimates(hlo)
    scattered = scatter_rows(hlo)
    gathered = gather_rows(hlo)
    # A copy XLA gives no estimate (e.g. an output written from VMEM to HBM twice) is still a copy: counted by bytes;
    # a scatter with none (the program's root), by its rows.
    seen = {n for n, _ in estimated}
    estimated += [(n, 0) for n in copies if n not in seen]
    estimated += [(n, 0) for n in scattered if n not in seen and n not in copies]  # a scatter with no estimate
    estimated += [(n, 0) for n in gathered if n not in seen and n not in copies and n not in scattered]
    for n, c in estimated:
        if n in mosaic_names:
            continue
        if n in copies:
            xla_ops.append(XlaOpModel(label, n, c, copies[n] / chip.dma_bytes_per_s, "bytes_moved", copies[n]))
            continue
        if n in scheduled and f"{n}/pre_delay" in files:
            # An elementwise or reduction op is a pipeline over windows like a kernel's grid: timed from its own
            # schedule and DMAs. XLA's estimate for these is several times what they take on the chip (v5e RMSNorm
            # 4096 x 2048: 78 + 102 us estimated for its two passes, 25.6 us each at the DMA bandwidth; the two
            # passes and the prefetch between them measured 71.3 us).
            k = _model_kernel(chip.xla_pipeline(), n, files, None, label, xla_op=True)
            warnings += [f"{n}: {w}" for w in k.warnings]
            xla_ops.append(XlaOpModel(label, n, c, k.modeled_s, "schedule", k.hbm_bytes))
            continue
        if n in matmuls:
            # A matmul's schedule shows its cycles but not the HBM stream of its operands (its DMAs are not the
            # kernel kind the model reads), and XLA's estimate overstates that stream: the dense MoE's weights at
            # decode, 1.3x over their bytes at the chip's read bandwidth, measured at it (Qwen3, 8 tokens: 1.21 GB
            # in 1,601 us, 0.92 of the table bandwidth, as our kernels' weight streams). So the larger of the two:
            # the cycles (compute-bound: within 2 % of XLA's estimate at 4096^3 and 8192^3) and the bytes at the
            # kernels' read and write efficiencies, each operand and the result moved once.
            reads, writes = matmuls[n]
            stream_s = float(chip.stream_s(reads, writes))
            estimate_s = math.inf if c >= _NO_ESTIMATE_CYCLES else c / chip.clock_hz
            if f"{n}/pre_delay" in files:
                k = _model_kernel(chip.xla_pipeline(), n, files, None, label, xla_op=True)
                warnings += [f"{n}: {w}" for w in k.warnings]
                compute_s = k.modeled_s
            else:
                compute_s = 0.0 if math.isinf(estimate_s) else estimate_s
            # Never above XLA's estimate: every matmul measured on the chip took at most that (the estimate 1.00-1.07x
            # the chip's time compute-bound, 1.3-1.5x streaming); a schedule read past it is not examined (v6e's
            # 8192^3 dot: 2,537 us from its schedule, 1,697 estimated, 1,195 at the MXU peak; no v6e measurement).
            modeled_s = min(estimate_s, max(compute_s, stream_s))
            basis = (
                "estimated_cycles"
                if modeled_s == estimate_s
                else "matmul_stream"
                if stream_s > compute_s
                else "matmul_schedule"
            )
            xla_ops.append(XlaOpModel(label, n, c, modeled_s, basis, reads + writes))
            continue
        if n in gathered and (c == 0 or c >= _NO_ESTIMATE_CYCLES):
            # A gather of whole-tile rows XLA gives no estimate (the paged XLA path's gathers of a cache's pages,
            # which counted 0) moves them as XLA's scatter does, a DMA a row, or their bytes where those take longer:
            # read from the operand, written to the result where that lies in HBM (gather_rows leaves out rows of
            # part of a tile: MoE routing's token rows, charged a DMA a row, put our experts_forward's prefill
            # programs at 1.4-1.8x the chip).
            rows, nbytes, written = gathered[n]
            row_s, stream_s = rows * chip.xla_scatter_row_s, float(chip.stream_s(nbytes, written))
            basis = "gather_rows" if row_s >= stream_s else "bytes_moved"
            xla_ops.append(XlaOpModel(label, n, c, max(row_s, stream_s), basis, nbytes + written))
            continue
        if n in scattered:
            # A row a DMA, one after the other: far above XLA's estimate of a few cycles (chips.Calibration).
            estimate_s = 0.0 if c >= _NO_ESTIMATE_CYCLES else c / chip.clock_hz
            row_s = scattered[n] * chip.xla_scatter_row_s
            xla_ops.append(
                XlaOpModel(
                    label, n, c, max(estimate_s, row_s), "scatter_rows" if row_s > estimate_s else "estimated_cycles"
                )
            )
            continue
        if c >= _NO_ESTIMATE_CYCLES:  # XLA's "no estimate" (INT64_MAX), e.g. a sort: not a time
            warnings.append(f"{n}: XLA gives no cycle estimate (estimated_cycles = {c}); counted as 0")
            continue
        xla_ops.append(XlaOpModel(label, n, c, c / chip.clock_hz))
    xla_ops += _async_copy_models(chip.xla_pipeline(), label, hlo, kernels, xla_ops)
    cost = info_all.get("cost", {})
    total = sum(k.modeled_s for k in kernels) + sum(x.modeled_s for x in xla_ops)
    notes = []
    for k in kernels:
        warnings += [f"{k.hlo_name}: {w}" for w in k.warnings if f"{k.kernel_name}: {w}" not in warnings]
        base = re.sub(r"[.]\d+$", "", k.hlo_name)  # "ragged-dot-none.1": one note line for XLA's copies of a kernel
        notes += [f"{base}: {n}" for n in k.notes]
    return ProgramModel(
        label=label,
        gen=gen,
        chip=chip.as_dict(),
        modeled_s=float(total),
        kernels=kernels,
        xla_ops=xla_ops,
        xla_optimal_seconds=cost.get("optimal_seconds"),
        cost_analysis=cost,
        memory_analysis=info_all.get("memory", {}),
        warnings=sorted(set(warnings)),
        notes=sorted(set(notes)),
    )
