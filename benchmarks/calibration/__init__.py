"""Measured TPU reference points for the static performance model, and the modeled-vs-measured table.

Each point is a kernel someone timed on a real TPU (the source and what was timed are in the point), rebuilt here
with the measured configuration so that `benchmarks.perf_model` can model it. `python -m benchmarks.calibration`
models every point and writes the table in docs/perf_model.md; tests/test_perf_calibration.py holds the model to it.
"""
