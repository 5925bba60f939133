"""The Hub build as the tests use it: scripts/build_hub.py, and a fresh build in a temporary repo-like folder."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "kernels-community/tpu-kernels"


def _load_build_script():
    spec = importlib.util.spec_from_file_location("build_hub", ROOT / "scripts" / "build_hub.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_hub", module)
    spec.loader.exec_module(module)
    return module


build_hub = _load_build_script()


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory) -> Path:
    """A repo-like directory holding build/torch-tpu and build/torch-cpu (what LOCAL_KERNELS points at)."""
    root = tmp_path_factory.mktemp("hub")
    build_hub.build(root / "build")
    # Like the repo: the library also scans the root for variants, where `torch-ext` parses as a (rejected) noarch
    # variant "torch-ext"; it must still fall through to build/.
    (root / "torch-ext").mkdir()
    return root
