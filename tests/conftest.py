"""Test-session setup: the environment for deviceless TPU compiles, set before jax or torch is imported."""
import os
import pathlib
import sys

# Deviceless compile for TPU topologies on a host with no TPU (shared/reference/TPU.md, rung 3). libtpu reads these
# when it loads, so they must be in place before the first `import jax` / `import torch` (torch auto-loads torch_tpu).
DEVICELESS_ENV = {
    "JAX_PLATFORMS": "cpu",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_ACCELERATOR_TYPE": "v6e-1",
    "PYTHONWARNINGS": "ignore::UserWarning:torch_tpu",
    "HF_HUB_OFFLINE": "1",
}
for _name, _value in DEVICELESS_ENV.items():
    os.environ.setdefault(_name, _value)

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The in-tree torch package (torch-ext/tpu_kernels, whose _pallas/ is the JAX kernels) and the shared test harness.
for _path in (ROOT / "torch-ext", ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


import json  # noqa: E402

from ladder import COMPILE_STATS, rand  # noqa: E402,F401  (the shared `rand` fixture)


def pytest_sessionfinish(session, exitstatus):
    """Keep the deviceless-compile memory stats of this run (rung 3) for people and the benchmarks."""
    if COMPILE_STATS:
        out = ROOT / "build" / "compile_stats.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(COMPILE_STATS, indent=1))
