"""pytest plumbing of the benchmark suites (benchmarks/test_*.py): environment, device, and the cases to time.

Run by `python -m benchmarks` (through pytest.main), or directly: `pytest benchmarks/test_rms_norm.py [--bench-full]`.
"""

from benchmarks import device as _device

_device.prepare_environment()  # before jax is imported

import pytest  # noqa: E402

from benchmarks import measured  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--bench-full",
        action="store_true",
        default=False,
        help="on a CPU, also time the mid-size shapes (interpret mode; slow)",
    )


@pytest.fixture(scope="session")
def bench_device() -> _device.Device:
    return _device.detect()


def pytest_generate_tests(metafunc):
    if "bench_case" in metafunc.fixturenames:
        full = metafunc.config.getoption("--bench-full", default=False)
        cases = measured.plan(metafunc.module.KERNEL, full=full)
        metafunc.parametrize("bench_case", cases, ids=[c.id.replace(" ", "-") for c in cases])
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", measured.IMPLS)
