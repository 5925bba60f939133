"""Modeled v6e-8 decode: one step per chip composed from the performance model's figures for the per-chip programs
(programs.py), the ring all-reduce (ring.py) and the layout's HBM-bound ceiling.

A step of an implementation = sum over layer kinds of count x (glue + kv write + attention at the context + experts
+ all-reduce of the experts' [B, H] output) + head. One layer of each kind is modeled and multiplied by its count: the
same routing draw stands for every layer. Our paged attention's visit-list builder is the exception: it follows from
the step's metadata only, and the compiled step builds the lists once (see _attention_s), so it counts once a step per
layer kind. Implementations:
- default: transformers' defaults, all XLA (grouped experts on XLA's ragged dot, sdpa over a static cache);
- experts: only the experts replaced by our experts_forward (the published Hub comparison's setup);
- ours_xla_attention: our experts_forward, RMSNorm and per-head RMSNorm + RoPE, XLA's attention;
- ours: every kernel of ours that applies (experts_forward, RMSNorm, per-head RMSNorm + RoPE, paged attention).

Each distinct program (its function, static options, argument shapes and concrete values) is modeled once per run
and kept in a JSON cache in the output directory (keyed also by the sources it follows from and the jax version), so a
re-run models only what changed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import pickle

import jax
import numpy as np

from .. import modeled as _modeled
from .. import perf_model
from ..perf_model import model as _model
from . import programs, ring, sharded
from .models import CHIPS, CONTEXTS, TOPOLOGY, Model

GEN = "v6e"
LABEL = "modeled v6e-8, excludes host dispatch"
IMPLS = ("default", "experts", "ours_xla_attention", "ours")
PARTS = {  # which variant of each program an implementation runs
    "default": {"glue": "default", "attention": "default", "experts": "default", "head": "default"},
    "experts": {"glue": "default", "attention": "default", "experts": "ours", "head": "default"},
    "ours_xla_attention": {"glue": "ours", "attention": "default", "experts": "ours", "head": "ours"},
    "ours": {"glue": "ours", "attention": "ours", "experts": "ours", "head": "ours"},
}
CACHE_FILE = "decode-model-cache.json"


def fits(model: Model, batch: int, context: int, hbm_bytes: int) -> tuple[bool, float]:
    """Whether a chip holds its weights and the replicated KV caches (GB needed)."""
    need = model.weight_bytes_per_chip() + model.kv_bytes_per_chip(batch, context)
    return need <= hbm_bytes, need / 1e9


def ceiling_bytes(model: Model, batch: int, context: int) -> int:
    """The least HBM bytes one chip reads and writes in a step: its replicated weights, the experts of its share that
    the batch touches, every layer's KV cache up to the context (and the new K/V written), the lm_head and the new
    tokens' embedding rows."""
    touched = programs.experts_touched(model, batch)
    total = 0
    for kind in model.kinds:
        per_layer = model.dense_bytes_per_layer(kind) + touched * model.expert_bytes()
        per_layer += batch * (kind.keys(context) + 1) * kind.kv_bytes_per_token
        total += kind.count * per_layer
    return total + model.vocab * model.hidden * 2 + batch * model.hidden * 2


@functools.cache
def _sources_digest() -> str:
    """The code a modeled figure follows from: the kernels, the benchmark ops, the performance model, these programs.
    Part of every cache key, so an edit to any of them re-models."""
    root = pathlib.Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    paths = [
        p for folder in ("kernels", "benchmarks/ops", "benchmarks/perf_model") for p in (root / folder).rglob("*.py")
    ]
    for path in sorted(paths + [root / "benchmarks/decode/programs.py", root / "benchmarks/decode/models.py"]):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def _key(fn, args, gen: str = GEN) -> str:
    """The program (function, static options, argument shapes), its concrete arguments' values, the generation it is
    modeled for, the sources, jax."""
    values = [
        hashlib.sha256(np.asarray(leaf).tobytes()).hexdigest()
        for leaf in jax.tree.leaves(args)
        if not isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    blob = pickle.dumps((fn, _model._arg_specs(args), values, gen, jax.__version__, _sources_digest()))
    return hashlib.sha256(blob).hexdigest()


def items_for(model: Model, batches, contexts) -> dict:
    """{(part, model, kind or "", batch, context or 0, variant): (fn, args)}: every program the table needs."""
    hbm = perf_model.get_chip(GEN).hbm_bytes
    out = {}
    for batch in batches:
        fitting = [c for c in contexts if fits(model, batch, c, hbm)[0]]
        if not fitting:
            continue
        for variant in programs.IMPLS:
            out[("experts", model.name, "", batch, 0, variant)] = programs.experts_item(model, batch, variant)
            out[("head", model.name, "", batch, 0, variant)] = programs.head_item(model, batch, variant)
            for kind in model.kinds:
                out[("glue", model.name, kind.name, batch, 0, variant)] = programs.glue_item(
                    model, kind, batch, variant
                )
                for context in fitting:
                    out[("attention", model.name, kind.name, batch, context, variant)] = programs.attention_item(
                        kind, batch, context, variant
                    )
        for kind in model.kinds:
            out[("kv_write", model.name, kind.name, batch, 0, "default")] = programs.kv_write_item(kind, batch)
    return out


def _stale(entry) -> bool:
    """Absent, or modeled before the cache kept each kernel's figure (compose() reads the visit-list builder's)."""
    return entry is None or ("error" not in entry and "kernel_s_by_name" not in entry)


def model_items(items: dict, cache_path: pathlib.Path | None, *, workers=None, bar=None, gen: str = GEN) -> dict:
    """{key: modeled seconds or an error string} on `gen`, from the cache where it holds the program."""
    cache = json.loads(cache_path.read_text()) if cache_path and cache_path.exists() else {}
    hashes = {key: _key(*item, gen) for key, item in items.items()}
    todo = [(key, lambda item=item: item) for key, item in items.items() if _stale(cache.get(hashes[key]))]
    if bar is not None:
        bar.total = len(todo)
        bar.refresh()
    step = _modeled.CHUNK * (workers or 2)
    for start in range(0, len(todo), step):  # a batch of chunks at a time, cached as it goes: an interrupted run
        # keeps what it modeled
        results = _modeled.run_items(todo[start : start + step], gen, bar=bar, workers=workers)
        for key, m in results.items():
            if isinstance(m, Exception):
                cache[hashes[key]] = {"error": f"{type(m).__name__}: {str(m)[:400]}"}
            else:
                by_name = {}
                for k in m.kernels:
                    by_name[k.kernel_name] = by_name.get(k.kernel_name, 0.0) + k.modeled_s
                cache[hashes[key]] = {
                    "program": " ".join(str(k) for k in key),
                    "s": m.modeled_s,
                    "kernels_s": sum(k.modeled_s for k in m.kernels),
                    "kernel_s_by_name": by_name,
                    "xla_s": sum(x.modeled_s for x in m.xla_ops),
                    "xla_bytes_accessed": m.cost_analysis.get("bytes accessed"),
                    "warnings": len(m.warnings),
                }
        if cache_path:
            cache_path.write_text(json.dumps(cache, indent=0, sort_keys=True))
    return {key: cache[hashes[key]] for key in items}


def _part(figures, key):
    entry = figures[key]
    if "error" in entry:
        raise RuntimeError(f"{key}: {entry['error']}")
    return entry["s"]


# the paged attention's visit-list builder (kernels/paged_attention/schedule.py)
VISITS_KERNEL = "paged_attention_visits"


def _attention_s(figures, key, count: int) -> float:
    """`count` layers' attention. Our paged attention's visit lists follow only from the step's metadata (kv_lens,
    cu_q_lens, num_seqs) and the layer kind's static layout, the same in every layer of the kind: in a compiled step
    XLA's CSE keeps one builder call and feeds its lists to every layer's kernel (a deviceless v6e compile of two
    layers over the same traced metadata holds one paged_attention_visits custom call, and the performance model
    prices that program with one builder), so the builder is charged once a step per kind, the kernel per layer."""
    once = figures[key].get("kernel_s_by_name", {}).get(VISITS_KERNEL, 0.0)
    return count * (_part(figures, key) - once) + once


def step_parts_s(model: Model, counts: dict, batch: int, context: int, impl: str, figures: dict, experts="experts"):
    """Seconds by part of one step of `impl` over `counts` ({layer kind: layers}): each layer's glue, KV write,
    attention at the context and experts (the figures keyed `experts`), then the head."""
    variant = PARTS[impl]
    parts = {"glue": 0.0, "kv_write": 0.0, "attention": 0.0, "experts": 0.0}
    per_layer_experts = _part(figures, (experts, model.name, "", batch, 0, variant["experts"]))
    for kind, count in counts.items():
        parts["glue"] += count * _part(figures, ("glue", model.name, kind.name, batch, 0, variant["glue"]))
        parts["kv_write"] += count * _part(figures, ("kv_write", model.name, kind.name, batch, 0, "default"))
        parts["attention"] += _attention_s(
            figures, ("attention", model.name, kind.name, batch, context, variant["attention"]), count
        )
        parts["experts"] += count * per_layer_experts
    parts["head"] = _part(figures, ("head", model.name, "", batch, 0, variant["head"]))
    return parts


def compose(model: Model, batch: int, context: int, figures: dict, *, step_latency_s: float) -> dict:
    """One table row: per implementation the step's seconds and its parts; the ceiling."""
    hbm = perf_model.get_chip(GEN)
    ok, need_gb = fits(model, batch, context, hbm.hbm_bytes)
    row = {"batch": batch, "context": context, "hbm_needed_gb": round(need_gb, 2), "impls": {}}
    if not ok:
        row["skipped"] = (
            f"needs {need_gb:.1f} GB a chip (weights + replicated KV caches) > {hbm.hbm_bytes / 1e9:.1f} GB"
        )
        return row
    all_reduce = ring.all_reduce_s(batch * model.hidden * 2, CHIPS, step_latency_s=step_latency_s)
    counts = {kind: kind.count for kind in model.kinds}
    for impl in IMPLS:
        try:
            parts = step_parts_s(model, counts, batch, context, impl, figures)
            parts["all_reduce"] = model.layers * all_reduce
            parts["head"] = parts.pop("head")  # the table's order of parts
        except RuntimeError as e:
            row["impls"][impl] = {"error": str(e)}
            continue
        step = sum(parts.values())
        row["impls"][impl] = {
            "ms": step * 1e3,
            "tokens_per_s": batch / step,
            "parts_ms": {k: v * 1e3 for k, v in parts.items()},
        }
    nbytes = ceiling_bytes(model, batch, context)
    ceiling = nbytes / hbm.hbm_bytes_per_s
    row["ceiling"] = {"ms": ceiling * 1e3, "tokens_per_s": batch / ceiling, "hbm_bytes": nbytes}
    return row


CHECK_BATCH = 64


def sharded_check(models, figures, context: int) -> list[dict]:
    """The default layer compiled for v6e:2x4 with the real sharding (sharded.py) beside the sum of the per-chip
    programs compose() adds for it (glue, attention, experts; the KV write and the all-reduce left out of both)."""
    rows = sharded.check(models, CHECK_BATCH, context)
    for row in rows:
        key = (row["model"], row["kind"], CHECK_BATCH)
        try:
            parts = [
                _part(figures, ("glue", key[0], key[1], CHECK_BATCH, 0, "default")),
                _part(figures, ("attention", key[0], key[1], CHECK_BATCH, context, "default")),
                _part(figures, ("experts", key[0], "", CHECK_BATCH, 0, "default")),
            ]
            row["composed_per_chip_ms"] = sum(parts) * 1e3
        except (KeyError, RuntimeError) as e:
            row["composed_per_chip_ms"] = None
            row["composed_error"] = str(e)
    return rows


def run(
    models,
    batches,
    contexts=CONTEXTS,
    *,
    out: pathlib.Path,
    workers=None,
    step_latency_s,
    bar=None,
    sharded_check_on=True,
) -> dict:
    """The modeled table: {"models": {name: {"series": [{"context", "rows"}]}}} plus what it assumed."""
    items = {}
    for model in models:
        items |= items_for(model, batches, contexts)
    figures = model_items(items, out / CACHE_FILE, workers=workers, bar=bar)
    result = {"models": {}}
    for model in models:
        series = []
        for context in contexts:
            rows = [compose(model, b, context, figures, step_latency_s=step_latency_s) for b in batches]
            series.append({"context": context, "rows": rows})
        result["models"][model.name] = {"hub_id": model.hub_id, "layers": model.layers, "series": series}
    result["programs_modeled"] = len(items)
    if sharded_check_on:
        result["sharded_check"] = sharded_check(models, figures, contexts[0])
    result["assumptions"] = {
        "topology": TOPOLOGY,
        "hbm_bytes_per_s_per_chip": perf_model.get_chip(GEN).hbm_bytes_per_s,
        "ici_link_bytes_per_s_per_direction": ring.LINK_BYTES_PER_S,
        "ici_step_latency_s": step_latency_s,
        "all_reduce": "bf16 [B, hidden] per layer, bidirectional ring over 8 chips",
    }
    return result
