"""Test-session setup. The environment for deviceless TPU compiles is applied before jax or torch is imported.

pytest puts tests/ on sys.path (rootdir conftest, "prepend" import mode), which is how `environment`, `hub` and
`ladder`, the shared test harness, are imported here and by the test modules.
"""

import importlib.util
import json
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # `benchmarks` (shapes declared once, the harness); appended: never shadows a library

import environment  # noqa: E402  (benchmarks.deviceless, on the path from the line above)

environment.apply()
# Host CPU devices: 8 by default, for the shard_map tests (test_sharded.py). jax's TPU interpreter then blocks one XLA
# CPU client thread per device at its cross-device barriers, and with fewer threads in the client's pool (NPROC;
# default: the cores, 2 here) than devices, a kernel whose scalar operands another kernel of the same program computed
# waits for them forever. The rest of the suite is faster on one device with the default pool (54 rms_norm reference
# checks on two xdist workers: 44.4 s against 50.2 s), so `make test` runs it with TPU_KERNELS_HOST_DEVICES=1 and
# test_sharded.py in a pytest process of its own.
HOST_DEVICES = int(os.environ.get("TPU_KERNELS_HOST_DEVICES", "8"))
if HOST_DEVICES > 1:
    os.environ.setdefault("NPROC", str(2 * HOST_DEVICES))
# The JAX kernels (`tpu_kernels_jax`) and the torch package (`tpu_kernels`) are installed editable by the Makefile.
if importlib.util.find_spec("torch") is None:
    # A JAX-only environment (the jax 0.12 / Python 3.12 compatibility run): modules that need torch run in the main
    # environment only.
    collect_ignore_glob = ["test_*_torch.py", "test_hub_package.py", "test_benchmarks.py", "test_imports.py"]

import cpu_compiles  # noqa: E402
import jax  # noqa: E402  (after the environment above)
from hub import hub_root  # noqa: E402,F401  (shared fixtures)
from ladder import COMPILE_STATS, moe_path  # noqa: E402,F401
from ladder import rand as rand  # noqa: E402  (the fixture)

jax.config.update("jax_num_cpu_devices", HOST_DEVICES)  # before the backend starts
assert cpu_compiles.lowest_optimization_for_cpu_compiles(), "jax's backend compile hook moved: see cpu_compiles.py"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Every failure of a test that drew random inputs names its seed, whatever assertion failed."""
    report = yield
    rand = getattr(item, "funcargs", {}).get("rand")
    if report.failed and rand is not None:
        report.sections.append(
            ("random inputs", f"{rand!r}; replay: TPU_KERNELS_TEST_SEED={rand.seed} pytest '{item.nodeid}'")
        )
    return report


def pytest_sessionfinish(session, exitstatus):
    """Keep the deviceless-compile memory stats of this run (rung 3) for people and the benchmarks."""
    if COMPILE_STATS:
        import jax

        # one file per xdist worker and host device count (make test's two pytest runs): they would overwrite each other
        tags = [os.environ.get("PYTEST_XDIST_WORKER"), f"{HOST_DEVICES}devices" if HOST_DEVICES > 1 else None]
        out = ROOT / "build" / f"compile_stats-jax{jax.__version__}{''.join('-' + t for t in tags if t)}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(COMPILE_STATS, indent=1))


# The jax 0.12 smoke set (scripts/jax_compat.sh) is a list of -k expressions over test ids; a renamed or merged test
# would silently drop out of it. With the list in TPU_KERNELS_SMOKE_SELECTIONS (one expression a line), a run over
# the whole suite refuses an expression that selects no test.
SMOKE_SELECTIONS = [e for e in os.environ.get("TPU_KERNELS_SMOKE_SELECTIONS", "").splitlines() if e.strip()]


@pytest.hookimpl(tryfirst=True)  # before pytest's own -k deselection: every collected test is still in `items`
def pytest_collection_modifyitems(config, items):
    if not SMOKE_SELECTIONS or config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return
    from _pytest.mark import KeywordMatcher
    from _pytest.mark.expression import Expression

    matchers = [KeywordMatcher.from_item(item) for item in items]
    empty = [e for e in SMOKE_SELECTIONS if not any(Expression.compile(e).evaluate(m) for m in matchers)]
    if empty:
        raise pytest.UsageError(f"smoke-set expressions that select no test (renamed or merged tests?): {empty}")
