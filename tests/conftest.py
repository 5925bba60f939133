"""Test-session setup. The environment for deviceless TPU compiles is applied before jax or torch is imported.

pytest puts tests/ on sys.path (rootdir conftest, "prepend" import mode), which is how `environment`, `hub` and
`ladder`, the shared test harness, are imported here and by the test modules.

With TPU_KERNELS_ON_CHIP=1 (`make tpu-check`, on a machine with a TPU) the session is the on-chip tier instead: no
deviceless environment, no host CPU devices, no CPU compile hooks; only the JAX kernel test modules (ON_CHIP_MODULES)
are collected, tests marked `cpu_only` are deselected, and the rung-1 helpers of tests/ladder.py compile the kernels
with Mosaic and run them on the chip.
"""

import importlib.util
import json
import os
import pathlib
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # `benchmarks` (shapes declared once, the harness); appended: never shadows a library

import environment  # noqa: E402  (benchmarks.deviceless, on the path from the line above)

ON_CHIP = environment.ON_CHIP
# The test modules of the on-chip tier: the JAX kernels against their references. Not the torch ops (no torch on a
# TPU test machine), the performance model, the Hub package, the benchmarks, nor the shard_map tests (8 host devices).
ON_CHIP_MODULES = (
    "test_rms_norm.py",
    "test_ragged_dot.py",
    "test_moe.py",
    "test_rotary.py",
    "test_flash_attention.py",
    "test_kv_cache.py",
    "test_paged_attention.py",
    "test_sweep.py",
)

if not ON_CHIP:
    environment.apply()
# Host CPU devices: 8 by default, for the shard_map tests (test_sharded.py). jax's TPU interpreter then blocks one XLA
# CPU client thread per device at its cross-device barriers, and with fewer threads in the client's pool (NPROC;
# default: the cores, 2 here) than devices, a kernel whose scalar operands another kernel of the same program computed
# waits for them forever. The rest of the suite is faster on one device with the default pool (54 rms_norm reference
# checks on two xdist workers: 44.4 s against 50.2 s), so `make test` runs it with TPU_KERNELS_HOST_DEVICES=1 and
# test_sharded.py in a pytest process of its own.
HOST_DEVICES = int(os.environ.get("TPU_KERNELS_HOST_DEVICES", "8"))
if HOST_DEVICES > 1 and not ON_CHIP:
    os.environ.setdefault("NPROC", str(2 * HOST_DEVICES))
# The JAX kernels (`tpu_kernels_jax`) and the torch package (`tpu_kernels`) are installed editable by the Makefile.
if importlib.util.find_spec("torch") is None:
    # A JAX-only environment (the jax 0.12 / Python 3.12 compatibility run): modules that need torch run in the main
    # environment only.
    collect_ignore_glob = ["test_*_torch.py", "test_hub_package.py", "test_benchmarks.py", "test_imports.py"]

import cpu_compiles  # noqa: E402
import jax  # noqa: E402  (after the environment above)
import ladder  # noqa: E402
from hub import hub_root  # noqa: E402,F401  (shared fixtures)
from ladder import COMPILE_STATS, moe_path  # noqa: E402,F401
from ladder import rand as rand  # noqa: E402  (the fixture)

if not ON_CHIP:
    jax.config.update("jax_num_cpu_devices", HOST_DEVICES)  # before the backend starts
    assert cpu_compiles.lowest_optimization_for_cpu_compiles(), "jax's backend compile hook moved: see cpu_compiles.py"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cpu_only: runs no kernel on a chip (TPU export, deviceless compiles, traced programs, tuning tables, "
        "argument checks, host-side code): deselected by the on-chip tier (TPU_KERNELS_ON_CHIP=1)",
    )
    if not ON_CHIP:
        return
    if os.environ.get("PYTEST_XDIST_WORKER") or getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("the on-chip tier runs in one process (one process may hold the chip): no -n")
    if config.option.collectonly:
        return  # nothing runs: collecting is possible on any host
    backend = jax.default_backend()
    if backend != "tpu":
        raise pytest.UsageError(
            f"TPU_KERNELS_ON_CHIP=1 but jax's default backend is {backend!r}, not a TPU: the on-chip tier needs the "
            "chip (make tpu-check on the TPU machine); make test runs the ladder on a CPU host"
        )
    _ON_CHIP_SESSION.update(device=str(jax.devices()[0].device_kind), started=time.monotonic())
    jax.monitoring.register_event_duration_secs_listener(_count_compile)


# ------------------------------------------------------------------------------------------------- on-chip tier
# What the on-chip session reports at its end: the chip, when it started, its compiles (count and seconds).
_ON_CHIP_SESSION = {"device": None, "started": None, "compiles": 0, "compile_seconds": 0.0}
# A wall-clock budget for the tier's tests (seconds; unset: none): past it the remaining tests are skipped, so that a
# run under a hard time limit still ends with its summary and its JUnit XML.
TIME_BUDGET_S = float(os.environ.get("TPU_KERNELS_TIME_BUDGET_S", "0")) or None


def _count_compile(event, duration_secs, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        _ON_CHIP_SESSION["compiles"] += 1
        _ON_CHIP_SESSION["compile_seconds"] += duration_secs


def _random_draws_last(item):
    """The on-chip order: the feature tests, then the random draws round by round over the kernel families, so that a
    time budget running out cuts the sweep evenly rather than a module's feature tests."""
    if getattr(item, "originalname", None) != "test_random_draw":
        return (0, 0)
    return (1, item.callspec.params["draw"])


def _in_chip_tier(path) -> bool:
    return pathlib.Path(str(path)).name in ON_CHIP_MODULES


def pytest_ignore_collect(collection_path, config):
    """On the chip only the tier's modules are collected (the others need torch, host devices or the perf model)."""
    if ON_CHIP and collection_path.is_file() and collection_path.name.startswith("test_"):
        return not _in_chip_tier(collection_path) or None
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The tier's tests run with ladder.CURRENT_TEST set: its helpers check the test's cpu_only marker against what
    the test calls (a rung-1 check in a cpu_only test, or a deviceless compile in one the chip would run, fails)."""
    ladder.CURRENT_TEST = item if _in_chip_tier(item.path) else None
    try:
        return (yield)
    finally:
        ladder.CURRENT_TEST = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    started = _ON_CHIP_SESSION["started"]
    if ON_CHIP and TIME_BUDGET_S and started is not None and time.monotonic() - started > TIME_BUDGET_S:
        pytest.skip(f"the on-chip tier's time budget (TPU_KERNELS_TIME_BUDGET_S={TIME_BUDGET_S:g}) is spent")


def pytest_unconfigure(config):
    """The on-chip tier's last line: its cases (tests run to a verdict) and failures, after pytest's own summary."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if not ON_CHIP or _ON_CHIP_SESSION["started"] is None or reporter is None:
        return
    nodes = {
        kind: {r.nodeid for r in reporter.stats.get(kind, []) if getattr(r, "nodeid", None)}
        for kind in ("passed", "failed", "error", "skipped")
    }
    failures = nodes["failed"] | nodes["error"]
    cases = (nodes["passed"] - nodes["skipped"]) | failures
    skipped = nodes["skipped"] - failures
    seconds = time.monotonic() - _ON_CHIP_SESSION["started"]
    reporter.write_line(
        f"on-chip tier ({_ON_CHIP_SESSION['device']}, {seconds:.0f} s, {_ON_CHIP_SESSION['compiles']} compiles in "
        f"{_ON_CHIP_SESSION['compile_seconds']:.0f} s, {len(skipped)} skipped)"
    )
    reporter.write_line(f"on-chip tier: {len(cases)} cases, {len(failures)} failures")


# --------------------------------------------------------------------------------------------------- every session
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
    if ON_CHIP:
        chip, host = [], []
        for item in items:
            (host if item.get_closest_marker("cpu_only") else chip).append(item)
        if host:
            config.hook.pytest_deselected(items=host)
        items[:] = sorted(chip, key=_random_draws_last)
    if not SMOKE_SELECTIONS or config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return
    from _pytest.mark import KeywordMatcher
    from _pytest.mark.expression import Expression

    matchers = [KeywordMatcher.from_item(item) for item in items]
    empty = [e for e in SMOKE_SELECTIONS if not any(Expression.compile(e).evaluate(m) for m in matchers)]
    if empty:
        raise pytest.UsageError(f"smoke-set expressions that select no test (renamed or merged tests?): {empty}")
