"""The static TPU performance model against measured TPU timings (benchmarks/calibration).

Every point of each module's quick subset is modeled once (chunks of points per compile subprocess); per family the
median modeled/measured of the in-fit points must be within 5 % and every in-fit point within 0.8-1.25. The failure
message holds the whole table, as `python -m benchmarks.calibration` prints it.
"""

import pytest

from benchmarks.calibration import table

MEDIAN_BOUNDS = (0.95, 1.05)
POINT_BOUNDS = (0.8, 1.25)


@pytest.fixture(scope="module")
def all_points():
    points, _ = table.collect_points()
    return points


@pytest.fixture(scope="module")
def rows():
    points, _ = table.collect_points(quick=True)  # each module's test-suite subset
    out = []  # the points out of the fit too: they give the dispatch of figures timed with it
    for gen in dict.fromkeys(p.gen for p in points):
        out += table.model_points(points, gen)
    return out


def test_points_have_a_source_and_unique_names(all_points):
    assert all_points
    assert not [p.name for p in all_points if not p.source.strip()]
    names = [p.name for p in all_points]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    # A point left out of the fit says why.
    assert not [p.name for p in all_points if not p.in_fit and not p.note.strip()]


def test_every_in_fit_point_is_modeled(rows):
    assert not [r for r in rows if r["error"]], table.markdown(rows)
    # Figures timed with host dispatch are compared with modeled + dispatch, estimated from their source.
    assert not [r["name"] for r in rows if r["in_fit"] and r["dispatch_included"] and r["dispatch_s"] is None]


def test_family_median_ratio_within_5pct(rows):
    lo, hi = MEDIAN_BOUNDS
    off = {}
    for gen in dict.fromkeys(r["gen"] for r in rows):
        for family, s in table.family_summary([r for r in rows if r["gen"] == gen]).items():
            if not lo <= s["median"] <= hi:
                off[f"{family} ({gen})"] = round(s["median"], 3)
    assert not off, f"median modeled/measured outside {lo}-{hi}: {off}\n\n{table.markdown(rows)}"


def test_every_in_fit_point_within_bounds(rows):
    lo, hi = POINT_BOUNDS
    off = {
        r["name"]: r["ratio"] and round(r["ratio"], 3)
        for r in rows
        if r["in_fit"] and (r["ratio"] is None or not lo <= r["ratio"] <= hi)
    }
    assert not off, f"modeled/measured outside {lo}-{hi}: {off}\n\n{table.markdown(rows)}"
