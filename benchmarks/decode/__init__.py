"""python -m benchmarks.decode: the v6e-8 decode table (see __main__.py)."""
