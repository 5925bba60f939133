"""Test-session setup. The environment for deviceless TPU compiles is applied before jax or torch is imported.

pytest puts tests/ on sys.path (rootdir conftest, "prepend" import mode), which is how `environment`, `hub` and
`ladder`, the shared test harness, are imported here and by the test modules.
"""
import json
import pathlib
import sys

import environment

environment.apply()

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "torch-ext"))  # the in-tree torch package; its _pallas/ is the JAX kernels

from hub import hub_root  # noqa: E402,F401  (shared fixtures)
from ladder import COMPILE_STATS, rand  # noqa: E402,F401


def pytest_sessionfinish(session, exitstatus):
    """Keep the deviceless-compile memory stats of this run (rung 3) for people and the benchmarks."""
    if COMPILE_STATS:
        out = ROOT / "build" / "compile_stats.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(COMPILE_STATS, indent=1))
