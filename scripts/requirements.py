"""Print the pinned requirements from pyproject.toml, one per line, for `pip install -r /dev/stdin`.

Usage: python scripts/requirements.py [extra ...]   (extras: test, bench)
"""
import pathlib
import sys
import tomllib

project = tomllib.loads((pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
lines = list(project["dependencies"])
for extra in sys.argv[1:]:
    lines += project["optional-dependencies"][extra]
print("\n".join(line.split("#")[0].strip() for line in lines))
