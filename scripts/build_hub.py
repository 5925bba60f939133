"""Build the Hugging Face Kernels Hub package: build/torch-<backend>/ for every backend in build.toml.

    .venv/bin/python scripts/build_hub.py [OUT_DIR]        (what `make build` runs; OUT_DIR defaults to build/)

Each variant is a torch "noarch" kernel laid out the way the `kernels` library loads it: the package itself at the
variant root (`build/torch-tpu/__init__.py`, `build/torch-tpu/metadata.json`), a self-contained copy of
`torch-ext/tpu_kernels/` with the JAX kernels (`kernels/`, the `tpu_kernels_jax` package) vendored as `_pallas/`.
In the tree the torch modules import the kernels by their one name, `from tpu_kernels_jax.<module> import ...`; the
build rewrites exactly those statements to relative ones (`from ._pallas.<module> import ...`). Per variant:

- `_ops.py` gets the op namespace `_tpu_kernels_<backend>_<hash>` (kernel-builder's `_<name>_<backend>_<rev>`), so
  two builds loaded into one process never register ops under the same name. `<hash>` is 7 hex digits of a SHA-256
  over the package sources, so it changes exactly when the sources do and the build is reproducible.
- `metadata.json` carries the fields `kernels.Metadata` requires (name, id, version, license, python-depends,
  backend); the id is the namespace, which is also the module name the library imports the package as.
- every import of the package's own code must be relative: the package is imported from an arbitrary path under a
  generated module name, so `import tpu_kernels...` (or `_pallas...`, `kernels.rms_norm...`) would break or, worse,
  silently load a different copy. The build fails naming each offending file and line.

Importable: `build(out_dir)` returns the written variants; tests build into a tmp dir with it.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import shutil
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_TOML = ROOT / "build.toml"
JAX_PACKAGE = "tpu_kernels_jax"  # the JAX kernels' import name in the tree (pyproject.toml)
JAX_SOURCES = ROOT / "kernels"
VENDORED = "_pallas"  # where the build puts them inside the torch package
DEV_NAMESPACE = "_tpu_kernels_dev"  # the in-tree namespace in torch-ext/tpu_kernels/_ops.py
HASH_LENGTH = 7
_IGNORED_DIRS = {"__pycache__"}
_IGNORED_SUFFIXES = {".pyc", ".pyo"}
# Names the package deliberately reuses for a third-party library (`tpu_kernels/jax.py` is the JAX API module);
# an absolute `import jax` means the real JAX, never the package's module.
_THIRD_PARTY_NAMES = {"jax", "torch"}


class BuildError(Exception):
    """The sources cannot be turned into a valid Hub package; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class Variant:
    backend: str
    path: Path
    kernel_id: str
    files: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class Config:
    name: str  # Hub kernel name, e.g. "tpu-kernels"
    version: int
    license: str
    backends: tuple[str, ...]

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")


def read_config(build_toml: Path = BUILD_TOML) -> Config:
    with open(build_toml, "rb") as f:
        general = tomllib.load(f)["general"]
    return Config(
        name=general["name"],
        version=int(general["version"]),
        license=general["license"],
        backends=tuple(general["backends"]),
    )


def _ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in _IGNORED_DIRS or n.startswith(".") or Path(n).suffix in _IGNORED_SUFFIXES}


def _files(package: Path) -> list[Path]:
    return sorted(p for p in package.rglob("*") if p.is_file())


def source_hash(package: Path) -> str:
    """7 hex digits of SHA-256 over (relative path, content) of every file of the copied package."""
    digest = hashlib.sha256()
    for path in _files(package):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:HASH_LENGTH]


def _internal_top_names(package: Path, python_name: str) -> set[str]:
    """Top-level names that, imported absolutely, would refer to this package's own code instead of itself."""
    names = {python_name, VENDORED, JAX_PACKAGE}
    for entry in package.iterdir():
        if entry.name in _IGNORED_DIRS:
            continue
        names.add(entry.stem if entry.is_file() else entry.name)
    pallas = package / VENDORED
    if pallas.is_dir():
        names.update(p.name for p in pallas.iterdir() if p.is_dir() and p.name not in _IGNORED_DIRS)
    return names - _THIRD_PARTY_NAMES


def absolute_internal_imports(package: Path, python_name: str) -> list[str]:
    """Every absolute import of the package's own code, as 'file:line: statement' (empty when all are relative).

    Checks `import X`, `from X import ...` and `importlib.import_module("X")` with a constant name, where X is the
    package name (`tpu_kernels`), `_pallas`, `tpu_kernels_jax` (left after vendoring), one of the package's own
    modules or kernel folders, or `kernels.<kernel folder>` (the repo-root JAX sources, which do not exist in the Hub
    package).
    """
    internal = _internal_top_names(package, python_name)
    pallas = package / VENDORED
    kernel_dirs = {p.name for p in pallas.iterdir() if p.is_dir()} if pallas.is_dir() else set()

    def is_internal(module: str) -> bool:
        parts = module.split(".")
        return parts[0] in internal or (parts[0] == "kernels" and len(parts) > 1 and parts[1] in kernel_dirs)

    offenders = []
    for path in _files(package):
        if path.suffix != ".py":
            continue
        rel = path.relative_to(package).as_posix()
        source = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(source, filename=rel)
        except SyntaxError as e:
            raise BuildError(f"{rel}:{e.lineno}: cannot parse: {e.msg}") from e
        for node in ast.walk(tree):
            modules: list[str] = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, (ast.Attribute, ast.Name))
                and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and not node.args[0].value.startswith(".")
            ):
                modules = [node.args[0].value]
            for module in modules:
                if is_internal(module):
                    statement = ast.get_source_segment(source, node) or module
                    offenders.append(f"{rel}:{node.lineno}: {statement}")
    return offenders


def vendor_jax_imports(package: Path) -> None:
    """Rewrite every `from tpu_kernels_jax[.x] import ...` in the torch package to `from ._pallas[.x] import ...`.

    Only that form is rewritten; `import tpu_kernels_jax...` is left for the absolute-import check to reject.
    """
    for path in _files(package):
        if path.suffix != ".py" or path.is_relative_to(package / VENDORED):
            continue
        depth = len(path.relative_to(package).parts)  # 1 for a module at the package root
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        changed = False
        for node in ast.walk(ast.parse("".join(lines), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                head, _, rest = node.module.partition(".")
                if head != JAX_PACKAGE:
                    continue
                line = lines[node.lineno - 1]
                relative = "." * depth + VENDORED + ("." + rest if rest else "")
                new = line.replace(f"from {node.module} ", f"from {relative} ", 1)
                if new == line:
                    raise BuildError(f"{path.name}:{node.lineno}: write `from {node.module} import ...` on one line")
                lines[node.lineno - 1] = new
                changed = True
        if changed:
            path.write_text("".join(lines), encoding="utf-8")


def _write_ops(package: Path, namespace: str) -> None:
    ops = package / "_ops.py"
    text = ops.read_text(encoding="utf-8")
    if DEV_NAMESPACE not in text:
        raise BuildError(f"{ops.name} does not contain the in-tree namespace {DEV_NAMESPACE!r} to replace")
    ops.write_text(text.replace(DEV_NAMESPACE, namespace), encoding="utf-8")


def build(
    out_dir: Path | str = ROOT / "build",
    *,
    package_dir: Path | str | None = None,
    jax_sources: Path | str = JAX_SOURCES,
    build_toml: Path | str = BUILD_TOML,
) -> list[Variant]:
    """Write `<out_dir>/torch-<backend>/` for every backend in build.toml, replacing old variants; return them.

    `package_dir` defaults to `torch-ext/<python name>/`; `jax_sources` (default `kernels/`) is vendored into it.
    """
    config = read_config(Path(build_toml))
    package_dir = Path(package_dir) if package_dir is not None else ROOT / "torch-ext" / config.python_name
    out_dir = Path(out_dir)
    if not (package_dir / "__init__.py").is_file():
        raise BuildError(f"no package at {package_dir} (expected {package_dir / '__init__.py'})")
    out_dir.mkdir(parents=True, exist_ok=True)

    # Stage one dereferenced copy, check it, hash it; every variant is that copy plus its _ops.py and metadata.json.
    staging = out_dir / f".staging-{config.python_name}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(package_dir, staging, symlinks=False, ignore=_ignore)
        if (staging / VENDORED).exists():
            raise BuildError(f"{package_dir} has its own {VENDORED}/; the build vendors {jax_sources} there")
        shutil.copytree(jax_sources, staging / VENDORED, symlinks=False, ignore=_ignore)
        vendor_jax_imports(staging)
        offenders = absolute_internal_imports(staging, config.python_name)
        if offenders:
            raise BuildError(
                "the Hub package must import its own code with relative imports only (it is loaded from an "
                f"arbitrary path under a generated module name); absolute imports found in {package_dir}:\n  "
                + "\n  ".join(offenders)
            )
        digest = source_hash(staging)

        # A stale variant directory would still be picked by the kernels library: remove every old one.
        for old in out_dir.glob("torch-*"):
            if old.is_dir():
                shutil.rmtree(old)

        variants = []
        for backend in config.backends:
            kernel_id = f"_{config.python_name}_{backend}_{digest}"
            target = out_dir / f"torch-{backend}"
            shutil.copytree(staging, target)
            _write_ops(target, kernel_id)
            metadata = {
                "name": config.name,
                "id": kernel_id,
                "version": config.version,
                "license": config.license,
                "python-depends": [],
                "backend": {"type": backend},
            }
            (target / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
            files = _files(target)
            leftovers = [
                p.relative_to(target).as_posix() for p in files if DEV_NAMESPACE in p.read_text("utf-8", "ignore")
            ]
            if leftovers:
                raise BuildError(f"the dev namespace {DEV_NAMESPACE!r} is still used in {leftovers}; use _ops.py")
            variants.append(Variant(backend, target, kernel_id, len(files), sum(p.stat().st_size for p in files)))
        return variants
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str]) -> int:
    out_dir = Path(argv[1]) if len(argv) > 1 else ROOT / "build"
    start = time.perf_counter()
    try:
        variants = build(out_dir)
    except BuildError as e:
        print(f"build_hub: error: {e}", file=sys.stderr)
        return 1
    for v in variants:
        shown = v.path.relative_to(ROOT) if v.path.is_relative_to(ROOT) else v.path
        print(f"wrote {shown}/  id {v.kernel_id}  ({v.files} files, {v.bytes / 1024:.0f} KiB)")
    print(f"build_hub: {len(variants)} variants in {time.perf_counter() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
