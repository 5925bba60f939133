"""Print pinned requirements from pyproject.toml, one per line, for `pip install -r /dev/stdin`.

Usage: python scripts/requirements.py [extra ...]   the main stack plus extras (test, bench)
       python scripts/requirements.py --jax-compat  the Python 3.12 / jax 0.12 compatibility environment
       python scripts/requirements.py --no-deps     packages installed without their dependencies (pip --no-deps)
"""

import pathlib
import sys
import tomllib

pyproject = tomllib.loads((pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
project = pyproject["project"]
if sys.argv[1:] == ["--jax-compat"]:
    lines = pyproject["tool"]["tpu-kernels"]["jax-compat"]["requires"]
elif sys.argv[1:] == ["--no-deps"]:
    lines = pyproject["tool"]["tpu-kernels"]["no-deps"]["requires"]
else:
    lines = list(project["dependencies"])
    for extra in sys.argv[1:]:
        lines += project["optional-dependencies"][extra]
print("\n".join(line.split("#")[0].strip() for line in lines))
