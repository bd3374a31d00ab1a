"""Wall-clock bounds for the slow tests' `tidal train` / `tidal eval` subprocesses.

A child that hangs is killed at its bound, and the test fails with `TimeoutExpired` naming the
command, before pytest's own per-test timeout (900 s, pyproject.toml) would end the whole test
with the child (and any Ray processes it started) still running. The default job's training
runs take 85-125 s here and an evaluation about 10 s (`make test-slow --durations`, a quiet
machine): the bounds leave 5x and more for a slower or busier one.
"""

TRAIN_TIMEOUT_S = 600
EVAL_TIMEOUT_S = 240
