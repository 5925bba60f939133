"""The Hub package (`make build`: build/torch-tpu, build/torch-cpu), loaded the way users load it: through the real
`kernels` library, `get_kernel("kernels-community/tpu-kernels", version=1)` with LOCAL_KERNELS, and
`get_local_kernel(path)`.

The module builds its own copy into a tmp dir with scripts/build_hub.py's `build()`, so it does not depend on the
state of build/. Everything that imports torch + TorchTPU runs in two subprocesses (one where the host is what it
is, a CPU host; one where the TPU backend is detected because `torch.backends.tpu` is present), forked once per module
from one process that did the imports both share (torch with TorchTPU, JAX, kernels: most of the probe's time), each
printing a JSON report that the tests below check one property at a time.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import environment
import pytest
from hub import REPO_ID, build_hub

ROOT = Path(__file__).resolve().parents[1]
# Every op of the build, with the backward op the registry derives for it.
EXPECTED_OPS = tuple(
    name + suffix
    for name in (
        "rms_norm",
        "fused_add_rms_norm",
        "ragged_dot",
        "experts_forward",
        "apply_rotary",
        "rms_norm_rope",
        "apply_rotary_from_positions",
        "rms_norm_rope_from_positions",
        "flash_attention",
        "flash_attention_varlen",
    )
    for suffix in ("", "_backward")
) + (
    "ragged_paged_attention",  # inference only: no backward op
    # inference ops that update caches in place: the mutating op and the functional op under it
    "reshape_and_cache_flash",
    "reshape_and_cache_flash_functional",
    "rope_and_reshape_and_cache_flash",
    "rope_and_reshape_and_cache_flash_functional",
)


@pytest.fixture(scope="module")
def variants(hub_root) -> dict[str, Path]:
    return {backend: hub_root / "build" / f"torch-{backend}" for backend in ("tpu", "cpu")}


# --------------------------------------------------------------------------------------------------------------
# The build output, without importing it.


def test_build_toml_is_valid_kernel_builder_config():
    from kernels._rust import Backend, Build

    config = Build.open(ROOT)  # kernel-builder's own parser (edition 5, unknown keys rejected)
    assert config.general.backends == [Backend.TPU, Backend.CPU]
    text = (ROOT / "build.toml").read_text()
    assert 'repo-id = "kernels-community/tpu-kernels"' in text and "[torch-noarch]" in text
    assert "genKernelFlakeOutputs" in (ROOT / "flake.nix").read_text()


def test_variants_are_complete_self_contained_packages(variants, tmp_path):
    # Bytecode is checked in a build of its own: the session's build has been imported by other tests, which write
    # their bytecode beside the sources (the source tree's own __pycache__ must not be copied into a build either).
    fresh = tmp_path / "build"
    build_hub.build(fresh)
    for backend, path in variants.items():
        assert (path / "__init__.py").is_file(), "the kernels library imports <variant>/__init__.py"
        for rel in (
            "_ops.py",
            "jax.py",
            "layers.py",
            "rms_norm_ops.py",
            "_pallas/rms_norm/api.py",
            "_pallas/rms_norm/kernel.py",
            "_pallas/common/interpret.py",
        ):
            assert (path / rel).is_file(), f"{backend}: {rel} missing"
        links = [p for p in path.rglob("*") if p.is_symlink()]
        assert not links, f"{backend}: symlinks left in the package (JAX sources must be real files): {links}"
        junk = [p for p in (fresh / path.name).rglob("*") if p.name == "__pycache__" or p.suffix == ".pyc"]
        assert not junk, f"{backend}: bytecode in the package: {junk}"
        assert not (path.parent / ".staging-tpu_kernels").exists()


def test_metadata_json(variants):
    from kernels._rust import Backend, Metadata

    ids = {}
    for backend, path in variants.items():
        raw = json.loads((path / "metadata.json").read_text())
        assert raw["name"] == "tpu-kernels"
        assert raw["version"] == 1
        assert raw["license"] == "Apache-2.0"
        assert raw["python-depends"] == []
        assert raw["backend"] == {"type": backend}
        assert raw["id"].startswith(f"_tpu_kernels_{backend}_") and len(raw["id"].rsplit("_", 1)[1]) == 7
        int(raw["id"].rsplit("_", 1)[1], 16)
        metadata = Metadata.read_from_file(path / "metadata.json")  # the library's validation
        assert metadata.id == raw["id"] and str(metadata.name) == "tpu-kernels" and metadata.version == 1
        assert metadata.backend.backend_type == {"tpu": Backend.TPU, "cpu": Backend.CPU}[backend]
        ids[backend] = raw["id"]
        ops = (path / "_ops.py").read_text()
        assert f"torch.ops.{raw['id']}\n" in ops and f"{raw['id']}::{{op_name}}" in ops
        assert "_tpu_kernels_dev" not in ops
    # Same sources, same hash; the namespaces differ by backend only.
    assert ids["tpu"].rsplit("_", 1)[1] == ids["cpu"].rsplit("_", 1)[1]
    assert ids["tpu"] != ids["cpu"]


def test_build_is_reproducible_and_replaces_old_variants(tmp_path, variants):
    out = tmp_path / "build"
    stale = out / "torch-xpu"
    stale.mkdir(parents=True)
    (out / "torch-cpu").mkdir()
    (out / "torch-cpu" / "leftover.py").write_text("")
    written = build_hub.build(out)
    assert sorted(v.path.name for v in written) == ["torch-cpu", "torch-tpu"]
    assert not stale.exists() and not (out / "torch-cpu" / "leftover.py").exists()
    for v in written:
        assert v.kernel_id == json.loads((variants[v.backend] / "metadata.json").read_text())["id"]


def test_all_imports_of_own_code_are_relative(variants):
    for path in variants.values():
        assert build_hub.absolute_internal_imports(path, "tpu_kernels") == []


@pytest.mark.parametrize(
    "statement",
    [
        "import tpu_kernels.rms_norm",
        "from tpu_kernels import layers",
        "from _pallas.rms_norm import api",
        "import tpu_kernels_jax.rms_norm.api",
        "from kernels.rms_norm import api",
        "import importlib\nimportlib.import_module('tpu_kernels.jax')",
    ],
)
def test_build_fails_on_absolute_import(tmp_path, statement):
    package = tmp_path / "tpu_kernels"
    shutil.copytree(
        ROOT / "torch-ext" / "tpu_kernels", package, symlinks=False, ignore=shutil.ignore_patterns("__pycache__")
    )
    with open(package / "layers.py", "a") as f:
        f.write("\n" + statement + "\n")
    with pytest.raises(build_hub.BuildError, match=r"relative imports only(.|\n)*layers\.py:\d+"):
        build_hub.build(tmp_path / "build", package_dir=package)
    assert not (tmp_path / "build" / "torch-cpu").exists()


def test_absolute_imports_of_third_party_libraries_are_allowed(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "jax.py").write_text("import jax\nfrom jax import numpy\nimport kernels\nimport torch\n")
    assert build_hub.absolute_internal_imports(package, "tpu_kernels") == []


# --------------------------------------------------------------------------------------------------------------
# Loading through the kernels library, in subprocesses.

_PROBE = r"""
import json, os, socket, sys, traceback, types
from pathlib import Path

root = Path(sys.argv[1])
report = {}

# No network: every way of opening a connection or resolving a name raises and is recorded.
ATTEMPTS = []
def _blocked(*args, **kwargs):
    ATTEMPTS.append(repr(args)[:200])
    raise OSError("network access blocked by test_hub_package")
socket.socket.connect = lambda self, *a, **k: _blocked(*a)
socket.socket.connect_ex = lambda self, *a, **k: _blocked(*a)
socket.create_connection = _blocked
socket.getaddrinfo = _blocked
socket.gethostbyname = _blocked
try:
    socket.create_connection(("127.0.0.1", 9))
except OSError:
    pass
report["network_guard_works"] = ATTEMPTS == ["(('127.0.0.1', 9),)"]
ATTEMPTS.clear()

# No compiles: JAX reports every trace, lowering and backend compile as a monitoring event.
import jax
EVENTS = []
def _on_event(name, *args, **kwargs):
    if name.startswith(("/jax/core/compile/", "/jax/compilation_cache/")):
        EVENTS.append(name)
jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_event)

import torch  # autoloads torch_tpu
import kernels
from kernels.backends import _backend

report["host_backend"] = _backend().name

def describe(module):
    ns = module.add_op_namespace_prefix("rms_norm").split("::")[0]
    return {
        "name": module.__name__,
        "variant": Path(module.__file__).parent.name,
        "namespace": ns,
        "ops": {op: hasattr(getattr(torch.ops, ns), op) for op in %(ops)r},
        "cpu_kernel": torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::rms_norm", "CPU"),
        "jax_rms_norm": callable(getattr(getattr(module, "jax", None), "rms_norm", None)),
    }

def probe(mode):
    if mode == "tpu":
        torch.backends.tpu = types.ModuleType("torch.backends.tpu")  # what torch_tpu sets on a TPU host
    report["backend"] = _backend().name
    kernel = kernels.get_kernel("kernels-community/tpu-kernels", version=1)
    report["get_kernel"] = describe(kernel)
    report["get_local_kernel_repo_is_same"] = kernels.get_local_kernel(root) is kernel
    report["get_local_kernel_build_is_same"] = kernels.get_local_kernel(root / "build") is kernel
    # The other variant in the same process: by backend on a TPU host, by its variant path on a CPU host.
    if mode == "tpu":
        other = kernels.get_kernel("kernels-community/tpu-kernels", version=1, backend="cpu")
    else:
        other = kernels.get_local_kernel(root / "build" / "torch-tpu")
    report["other"] = describe(other)
    report["loaded"] = sorted(k.metadata.id for k in kernels.get_loaded_kernels())
    report["network_attempts"] = list(ATTEMPTS)
    report["compile_events_at_import"] = sorted(set(EVENTS))
    report["dynamo_frames_at_import"] = sum(torch._dynamo.utils.counters["frames"].values())

    # Numerics through the op (CPU: the Pallas kernel in TPU interpret mode), against plain torch.
    if mode == "cpu":
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 256, generator=g)
        w = torch.randn(256, generator=g)
        eps = 1e-6
        x64, w64 = x.double(), w.double()
        ref = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64).float()
        for key, module in (("numerics", kernel), ("numerics_other", other)):
            y = module.rms_norm(x, w, eps)
            try:
                torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
                report[key] = "ok"
            except AssertionError as e:
                report[key] = str(e)
            report[key + "_dtype_shape"] = [str(y.dtype), list(y.shape)]
        report["compile_events_after_call"] = len(EVENTS)  # the detector's positive control
    report["network_attempts_total"] = list(ATTEMPTS)
    Path(f"report-{mode}.json").write_text(json.dumps(report))  # a file each: the children print at the same time


# Each mode in a child forked here, after the imports: each loads the variants into a process of its own, in its own
# order. No JAX backend exists yet (nothing has been compiled), so JAX has no threads of its own to lose in the fork.
from jax._src import xla_bridge
assert not xla_bridge.backends_are_initialized(), "a JAX backend was initialized before the fork"
sys.stdout.flush()
sys.stderr.flush()
children = {}
for mode in ("cpu", "tpu"):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            probe(mode)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    children[mode] = pid
codes = {mode: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for mode, pid in children.items()}
print("EXIT " + json.dumps(codes), flush=True)
sys.exit(1 if any(codes.values()) else 0)
""" % {"ops": EXPECTED_OPS}  # noqa: UP031  (the probe is a script full of braces)


@pytest.fixture(scope="module")
def reports(hub_root, tmp_path_factory) -> dict[str, dict]:
    """Run the probe: one report per mode ('cpu': this host as it is; 'tpu': torch.backends.tpu present), each from a
    child process of its own."""
    work = tmp_path_factory.mktemp("probe")
    script = work / "probe.py"
    script.write_text(_PROBE)
    env = environment.subprocess_env(LOCAL_KERNELS=f"{REPO_ID}={hub_root}")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, str(script), str(hub_root)], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"probe failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {mode: json.loads((work / f"report-{mode}.json").read_text()) for mode in ("cpu", "tpu")}


def _ids(variants) -> dict[str, str]:
    return {b: json.loads((p / "metadata.json").read_text())["id"] for b, p in variants.items()}


def test_cpu_host_gets_the_cpu_variant(reports, variants):
    report = reports["cpu"]
    assert report["host_backend"] == "cpu" and report["backend"] == "cpu"
    loaded = report["get_kernel"]
    assert loaded["variant"] == "torch-cpu"
    assert loaded["name"] == loaded["namespace"] == _ids(variants)["cpu"]
    assert all(loaded["ops"].values()), loaded["ops"]
    assert loaded["cpu_kernel"] and loaded["jax_rms_norm"]


def test_get_local_kernel_accepts_repo_and_build_dirs(reports):
    for report in reports.values():
        assert report["get_local_kernel_repo_is_same"] and report["get_local_kernel_build_is_same"]


def test_tpu_backend_gets_the_tpu_variant_and_registers_ops_on_a_cpu_host(reports, variants):
    report = reports["tpu"]
    assert report["host_backend"] == "cpu", "this test expects a CPU host; on a TPU host it proves less"
    assert report["backend"] == "tpu"
    loaded = report["get_kernel"]
    assert loaded["variant"] == "torch-tpu"
    assert loaded["name"] == loaded["namespace"] == _ids(variants)["tpu"]
    assert all(loaded["ops"].values()), loaded["ops"]
    assert loaded["cpu_kernel"] and loaded["jax_rms_norm"]


def test_two_variants_in_one_process_use_different_namespaces(reports, variants):
    ids = _ids(variants)
    for mode, report in reports.items():
        first, other = report["get_kernel"], report["other"]
        assert {first["variant"], other["variant"]} == {"torch-cpu", "torch-tpu"}, mode
        assert first["namespace"] != other["namespace"]
        assert {first["namespace"], other["namespace"]} == set(ids.values())
        assert all(other["ops"].values()) and other["cpu_kernel"]
        assert report["loaded"] == sorted(ids.values())


def test_import_makes_no_network_access(reports):
    for mode, report in reports.items():
        assert report["network_guard_works"], mode
        assert report["network_attempts"] == [], (mode, report["network_attempts"])
        assert report["network_attempts_total"] == [], (mode, report["network_attempts_total"])


def test_import_compiles_nothing(reports):
    for mode, report in reports.items():
        assert report["compile_events_at_import"] == [], (mode, report["compile_events_at_import"])
        assert report["dynamo_frames_at_import"] == 0, mode
    # The detector sees the compiles of an actual call, so an empty list above means something.
    assert reports["cpu"]["compile_events_after_call"] > 0


def test_rms_norm_through_the_loaded_kernel_matches_torch(reports):
    report = reports["cpu"]
    assert report["numerics"] == "ok", report["numerics"]
    assert report["numerics_other"] == "ok", report["numerics_other"]
    assert report["numerics_dtype_shape"] == ["torch.float32", [8, 256]]
