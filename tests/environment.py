"""The process environment of every test process and subprocess: the deviceless-compile settings of
`benchmarks.deviceless` (one definition for tests, benchmarks and the performance model)."""

from benchmarks.deviceless import DEVICELESS_ENV, apply, subprocess_env

__all__ = ["DEVICELESS_ENV", "apply", "subprocess_env"]
