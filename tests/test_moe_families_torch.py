"""docs/moe.md's survey of transformers' MoE families against the installed transformers, read from its modeling
sources (no model is imported, so the check takes well under a second): the experts classes that use the experts
interface (`@use_experts_implementation`) are exactly the first table's rows ("runs" or "raises"), and every other
class named `...Experts` (shared experts, dense MLPs beside the routed ones, aside) is a "does not run" row of the
second table, as is every class that table names. A transformers upgrade that adds, removes or converts an experts
class fails here until the tables say what happens to it. Named *_torch.py: it needs transformers, which the JAX-only
environment does not install."""

import importlib.util
import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "moe.md"
SECTION = "## transformers MoE families"
CLASS = re.compile(r"^class (\w+)\(")
ROW = re.compile(r"^\| ([a-z0-9_]+) \| (\w+) \|.*\| ([^|]+) \|$", re.M)


def _modeling_classes():
    """{(model, class): uses the experts interface} for every class of transformers/models/*/modeling_*.py."""
    (root,) = importlib.util.find_spec("transformers").submodule_search_locations
    classes = {}
    for path in sorted(pathlib.Path(root, "models").glob("*/modeling_*.py")):
        decorators = []  # the decorator lines just above the current line
        for line in path.read_text().splitlines():
            match = CLASS.match(line)
            if match:
                classes[(path.parent.name, match.group(1))] = any("use_experts_implementation" in d for d in decorators)
            decorators = [*decorators, line] if line.startswith("@") else []
    return classes


def _table_rows():
    """{(model, class): the experts_forward column} of the section's tables."""
    text = DOC.read_text()
    start = text.index(SECTION)
    section = text[start : text.index("\n## ", start + len(SECTION))]
    return {(model, cls): status.strip() for model, cls, status in ROW.findall(section)}


def test_moe_survey_tables_match_the_installed_transformers():
    classes, rows = _modeling_classes(), _table_rows()
    interface = {key for key, decorated in classes.items() if decorated}
    listed = {key for key, status in rows.items() if status == "runs" or status.startswith("raises")}
    outside = {key for key, status in rows.items() if status == "does not run"}
    assert set(rows) == listed | outside, f"rows of neither kind: {sorted(set(rows) - listed - outside)}"
    assert sorted(listed - interface) == [], "listed as experts-interface classes but not ones in this transformers"
    assert sorted(interface - listed) == [], "experts-interface classes missing from the first table"
    other_experts = {
        key
        for key, decorated in classes.items()
        if not decorated and key[1].endswith("Experts") and "Shared" not in key[1]
    }
    assert sorted(other_experts - outside) == [], "experts modules outside the interface missing from the second table"
    stale = sorted(key for key in outside if classes.get(key) is not False)
    assert stale == [], "second-table rows that are not a class outside the interface in this transformers"
    runs = sum(status == "runs" for status in rows.values())
    assert f"of {len(interface)} classes {runs} pass them" in DOC.read_text().replace("\n", " ")
