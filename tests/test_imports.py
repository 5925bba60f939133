"""One import name for the JAX kernels: every module of the repository is loaded once per process."""

import collections
import importlib
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_DIRS = [ROOT / d for d in ("kernels", "torch-ext", "benchmarks", "tests", "scripts")]


def _repo_modules_by_file() -> dict[pathlib.Path, list[str]]:
    by_file = collections.defaultdict(list)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and any(pathlib.Path(file).resolve().is_relative_to(d) for d in SOURCE_DIRS):
            by_file[pathlib.Path(file).resolve()].append(name)
    return by_file


def test_the_torch_package_benchmarks_and_tests_share_one_copy_of_each_kernel_module():
    import tpu_kernels
    import tpu_kernels_jax.api

    for name in ("benchmarks.ops.rms_norm", "benchmarks.ops.rotary", "benchmarks.ops.moe", "benchmarks.measured"):
        importlib.import_module(name)
    twice = {str(f.relative_to(ROOT)): names for f, names in _repo_modules_by_file().items() if len(names) > 1}
    assert twice == {}, f"modules loaded under more than one name: {twice}"
    assert tpu_kernels.jax.rms_norm is tpu_kernels_jax.api.rms_norm
    assert pathlib.Path(tpu_kernels_jax.api.__file__).resolve() == ROOT / "kernels" / "api.py"


def test_kernels_from_the_repository_root_is_the_hugging_face_library():
    code = "import kernels, tpu_kernels_jax.rms_norm.api as a; print(kernels.__file__); print(a.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    kernels_file, api_name = out.split()
    assert "site-packages" in kernels_file and not pathlib.Path(kernels_file).resolve().is_relative_to(ROOT / "kernels")
    assert api_name == "tpu_kernels_jax.rms_norm.api"
