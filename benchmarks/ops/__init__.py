"""One module per kernel, each defining `SUITE` (see benchmarks/suite.py)."""
