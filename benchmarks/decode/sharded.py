"""The default layer compiled deviceless for the whole v6e-8 (`v6e:2x4`) with the real sharding: expert weights split
over the 8 chips (P("ep")), everything else replicated, the experts in a shard_map that renumbers the routing to each
chip's experts and all-reduces their outputs. The compiled HLO is the per-chip SPMD program: its XLA ops, modeled,
check the per-chip composition (compose.py), which models the same work as separate one-chip programs so that each
kernel can be modeled at its concrete per-chip routing. The all-reduce carries no cycle estimate (counted as 0 here:
the ring model times it).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from tpu_kernels_jax.moe import expert_parallel

from .. import perf_model
from ..ops import moe
from ..perf_model import model as _model
from . import programs
from .models import CHIPS, TOPOLOGY, LayerKind, Model

AXIS = "ep"


def _experts_shard(hidden, top_i, top_w, gate_up, down, *, activation):
    local = expert_parallel.local_expert_ids(top_i, AXIS, gate_up.shape[0])
    part = moe.xla_experts(hidden, local, top_w, gate_up, down, activation=activation)
    return jax.lax.psum(part, AXIS)  # in the model dtype, as transformers' expert-parallel all-reduce


def default_layer(x, k_cache, v_cache, lengths, w, cos, sin, gate_up, down, *, model: Model, kind: LayerKind):
    """One whole layer of the default implementation (the KV write aside) over the context mesh."""
    q, _, _ = programs.attention_in(x, w, cos, sin, kind=kind, impl="default")
    attn = programs.static_cache_attention(q[:, 0], k_cache, v_cache, lengths, kind=kind)
    moe_in, out, top_i, top_w = programs.attention_out(x, attn, w, model=model, impl="default")
    experts = jax.shard_map(
        functools.partial(_experts_shard, activation=model.activation),
        in_specs=(P(), P(), P(), P(AXIS), P(AXIS)),
        out_specs=P(),
    )(moe_in, top_i, top_w, gate_up, down)
    return out + experts


def layer_item(model: Model, kind: LayerKind, batch: int, context: int):
    """(fn, args, partition specs): global shapes (all experts), the experts' weights split over the chips."""
    x, _, w, cos, sin = programs.glue_args(model, kind, batch)
    _, (q, k_cache, v_cache, lengths) = programs.attention_item(kind, batch, context, "default")
    del q
    e, h, i = model.experts, model.hidden, model.expert_intermediate
    args = (x, k_cache, v_cache, lengths, w, cos, sin, programs._spec(e, 2 * i, h), programs._spec(e, h, i))
    pspecs = [()] * (len(jax.tree.leaves(args)) - 2) + [(AXIS,), (AXIS,)]
    return functools.partial(default_layer, model=model, kind=kind), args, pspecs


def check(models, batch: int, context: int) -> list[dict]:
    """Per layer kind: the sharded default layer's modeled time beside the parts compose.py adds for it."""
    items = [(m, kind) for m in models for kind in m.kinds]
    compiled = _model.compile_deviceless_many(
        [layer_item(m, kind, batch, context) for m, kind in items],
        "v6e",
        dump=True,
        topology=TOPOLOGY,
        mesh_axes=((AXIS, CHIPS),),
    )
    chip = perf_model.get_chip("v6e")
    out = []
    for (m, kind), c in zip(items, compiled):
        row = {"model": m.name, "kind": kind.name, "batch": batch, "context": context, "topology": TOPOLOGY}
        if isinstance(c, Exception):
            row["error"] = f"{type(c).__name__}: {str(c)[:400]}"
        else:
            pm = _model._assemble(chip, [], [], c)
            row["sharded_layer_ms"] = pm.modeled_s * 1e3
            row["ops_without_estimate"] = sum("no cycle estimate" in w for w in pm.warnings)
            row["collectives"] = sorted(
                {op for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all") if op in c[0]["hlo"]}
            )
        out.append(row)
    return out
