"""Subprocess entry: deviceless compile of one function for one TPU topology.

Run as `python _worker.py PAYLOAD.pkl OUT.json`. The parent sets the environment
(JAX_PLATFORMS=cpu, TPU_SKIP_MDS_QUERY=1, TPU_WORKER_HOSTNAMES=localhost,
ALLOW_MULTIPLE_LIBTPU_LOAD=1 and, when it wants bundle dumps, LIBTPU_INIT_ARGS with
--xla_jf_dump_to / --xla_mosaic_dump_to): libtpu reads its flags only when it is
loaded, which is why this is a fresh process. This file imports nothing from the
project, so it works whatever the parent's package layout is; the payload carries
the parent's sys.path so the pickled function (pickled by reference) can be found.
"""

import json
import pickle
import sys


def main(payload_path: str, out_path: str) -> None:
  with open(payload_path, "rb") as f:
    sys_path, blob = pickle.load(f)
  for p in reversed(sys_path):
    if p not in sys.path:
      sys.path.insert(0, p)
  fn, arg_specs, topology = pickle.loads(blob)

  import jax
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(topology, "tpu")
  dev = topo.devices[0]
  sharding = jax.sharding.SingleDeviceSharding(dev)

  def to_sds(leaf):
    if isinstance(leaf, tuple) and len(leaf) == 3 and leaf[0] == "__spec__":
      return jax.ShapeDtypeStruct(leaf[1], leaf[2], sharding=sharding)
    return leaf

  args = jax.tree.map(to_sds, arg_specs,
                      is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3 and x[0] == "__spec__")
  with jax.default_device(dev):
    compiled = jax.jit(fn).lower(*args).compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax returned a list of dicts
    cost = cost[0] if cost else {}
  try:
    mem = compiled.memory_analysis()
    mem = {k: getattr(mem, k) for k in dir(mem)
           if k.endswith("_in_bytes") and isinstance(getattr(mem, k), int)}
  except Exception:  # noqa: BLE001 - optional information
    mem = {}
  out = {
      "hlo": compiled.as_text(),
      "cost": {k: float(v) for k, v in (cost or {}).items()},
      "memory": mem,
      "device_kind": dev.device_kind,
      "jax_version": jax.__version__,
  }
  with open(out_path, "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
