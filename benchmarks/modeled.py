"""Modeled times: the kernel and the default implementation of every case through the static performance model.

Each `perf_model.model_function` call compiles in its own subprocess (~3-5 s here, most of it the subprocess's start:
importing jax and loading libtpu). The calls run on a thread pool of `workers` (default 1: on this 2-core machine two
concurrent compile subprocesses were slower in total than one, 104 s vs 87 s for 16 calls).
"""
from __future__ import annotations

import concurrent.futures

from . import perf_model
from . import suite as _suite

IMPLS = _suite.IMPLS


def _model_one(case: _suite.Case, impl: str, gen: str):
    op = case.op
    args = op.model_args(case.shape) if op.model_args else op.specs(case.shape)
    return perf_model.model_function(op.kernel if impl == "kernel" else op.default, args, gen=gen)


def run(cases: list[_suite.Case], gen: str, *, bar=None, workers: int | None = None) -> dict:
    """{(case id, impl): ProgramModel or the Exception that modeling raised}."""
    workers = workers or 1
    results = {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(_model_one, c, impl, gen): (c.id, impl) for c in cases for impl in IMPLS}
        for future in concurrent.futures.as_completed(futures):
            try:
                results[futures[future]] = future.result()
            except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
                results[futures[future]] = e
            if bar is not None:
                bar.update(1)
    return results
