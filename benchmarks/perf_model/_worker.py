"""Subprocess entry: deviceless compile of one or several functions for one TPU topology.

Run as `python _worker.py PAYLOAD.pkl OUT.json`. The parent sets the environment
(JAX_PLATFORMS=cpu, TPU_SKIP_MDS_QUERY=1, TPU_WORKER_HOSTNAMES=localhost,
ALLOW_MULTIPLE_LIBTPU_LOAD=1 and, when it wants bundle dumps, LIBTPU_INIT_ARGS with
--xla_jf_dump_to / --xla_mosaic_dump_to): libtpu reads its flags only when it is
loaded, which is why this is a fresh process. This file imports nothing from the
project, so it works whatever the parent's package layout is; the payload carries
the parent's sys.path so the pickled functions (pickled by reference) can be found.

Payload: (sys_path, blob, dump_dir); blob unpickles to (topology, [(fn, arg_specs, partition specs or None), ...],
mesh axes or None). With mesh axes ((name, size), ...) the functions compile over a mesh of every chip of the
topology, each array argument sharded by its partition spec (one tuple per leaf of arg_specs, in order).
The functions compile one after the other; after each compile the dump files that
appeared in dump_dir are moved to dump_dir/<index>/, so each program's kernels are
found in its own folder. OUT.json is a list with one entry per function: the compile
info, or {"error": "..."} when that function failed (the others still compile).
"""

import json
import os
import pickle
import sys
import traceback


class _AsTextFailed(RuntimeError):
    """compiled.as_text() failed; the parent retries with XLA's own text dump (XLA_FLAGS=--xla_dump_to)."""


def _dumped_hlo():
    """The optimized HLO text XLA dumped (XLA_FLAGS --xla_dump_to=$PERF_MODEL_XLA_DUMP), or None."""
    xla_dir = os.environ.get("PERF_MODEL_XLA_DUMP")
    if not xla_dir or not os.path.isdir(xla_dir):
        return None
    names = sorted(n for n in os.listdir(xla_dir) if n.endswith(".after_optimizations.txt"))
    if not names:
        return None
    with open(os.path.join(xla_dir, names[-1])) as f:
        return f.read()


def _compile_one(fn, arg_specs, dev, mesh=None, pspecs=None):
    import contextlib

    import jax

    is_spec = lambda x: isinstance(x, tuple) and len(x) == 3 and x[0] == "__spec__"  # noqa: E731
    leaves, tree = jax.tree.flatten(arg_specs, is_leaf=is_spec)
    shardings = iter(
        [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*p)) for p in pspecs] if mesh is not None else []
    )
    single = jax.sharding.SingleDeviceSharding(dev)
    args = [
        jax.ShapeDtypeStruct(leaf[1], leaf[2], sharding=next(shardings) if mesh is not None else single)
        if is_spec(leaf)
        else leaf
        for leaf in leaves
    ]
    args = jax.tree.unflatten(tree, args)
    with jax.default_device(dev), jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        # donated arguments (model.donated): an in-place program's state, aliased to its outputs as a server runs it
        compiled = jax.jit(fn, donate_argnums=getattr(fn, "donate_argnums", ())).lower(*args).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned a list of dicts
        cost = cost[0] if cost else {}
    try:
        mem = compiled.memory_analysis()
        mem = {k: getattr(mem, k) for k in dir(mem) if k.endswith("_in_bytes") and isinstance(getattr(mem, k), int)}
    except Exception:  # noqa: BLE001 - optional information
        mem = {}
    hlo_source = "executable"
    try:
        hlo = compiled.as_text()
    except Exception as e:  # noqa: BLE001 - some programs (e.g. with sparsecore async ops) fail to print from proto
        hlo = _dumped_hlo()
        hlo_source = "xla_dump"
        if hlo is None:
            raise _AsTextFailed(f"{type(e).__name__}: {e}") from e
    return {
        "hlo": hlo,
        "hlo_source": hlo_source,
        "cost": {k: float(v) for k, v in (cost or {}).items()},
        "memory": mem,
        "device_kind": dev.device_kind,
        "jax_version": jax.__version__,
    }


def main(payload_path: str, out_path: str) -> None:
    with open(payload_path, "rb") as f:
        sys_path, blob, dump_dir = pickle.load(f)
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)

    import jax
    from jax.experimental import topologies

    topology, items, mesh_axes = pickle.loads(blob)
    devices = topologies.get_topology_desc(topology, "tpu").devices
    dev = devices[0]
    mesh = None
    if mesh_axes:  # a sharded program over every chip of the topology
        import numpy as np

        names, sizes = zip(*mesh_axes)
        mesh = jax.sharding.Mesh(np.array(devices).reshape(sizes), names)
    out = []
    for i, (fn, arg_specs, pspecs) in enumerate(items):
        try:
            out.append(_compile_one(fn, arg_specs, dev, mesh, pspecs))
        except Exception as e:  # noqa: BLE001 - one failing function must not lose the others
            out.append(
                {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-4000:],
                    "as_text_failed": isinstance(e, _AsTextFailed),
                }
            )
        xla_dir = os.environ.get("PERF_MODEL_XLA_DUMP")
        if xla_dir and os.path.isdir(xla_dir):
            for name in os.listdir(xla_dir):
                path = os.path.join(xla_dir, name)
                if os.path.isfile(path):
                    os.remove(path)
        if dump_dir and os.path.isdir(dump_dir):
            sub = os.path.join(dump_dir, str(i))
            os.makedirs(sub)
            for name in os.listdir(dump_dir):
                path = os.path.join(dump_dir, name)
                if os.path.isfile(path):
                    os.rename(path, os.path.join(sub, name))
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
