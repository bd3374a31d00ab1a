"""What every `tidal` command shares: the split of CONFIG.yaml files from overrides, the
errors a person can act on (exit 2), and the stop signals.

SIGTERM and SIGINT are caught by handlers of this module rather than left to Python's own,
so that a run or a server stops the same way on either, also where SIGINT was ignored.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from tidal.config import ConfigError
from tidal.envs.dataset import DatasetError
from tidal.models import ModelLoadError
from tidal.rewards.pool import RewardLoadError
from tidal.runtime.replay import ReplayError

USER_ERRORS = (ConfigError, ModelLoadError, DatasetError, RewardLoadError, FileExistsError, FileNotFoundError,
               ReplayError)
RUN_FAILED_EXIT = 3  # the run stopped itself (failure budget); its last checkpoint is intact


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(config files, overrides): several files merge in order, later ones winning (config.load_config)."""
    configs, overrides = [], []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif a.endswith((".yaml", ".yml")):
            configs.append(a)
        else:
            raise ConfigError(f"unexpected argument `{a}`: expected YAML config files or `section.key=value`")
    return configs, overrides


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt."""


def _terminated(signum, frame):
    raise Terminated()


def _interrupted(signum, frame):
    """Python's own SIGINT behaviour, but not its handler object: `asyncio.run` replaces that one
    while a loop runs (the rollout runs one on the main thread at k=0) with a handler that only
    cancels the loop's main task, and a SIGINT that lands as the task finishes is then lost.
    This one raises KeyboardInterrupt wherever the main thread is, inside a loop too."""
    raise KeyboardInterrupt()


def catch_stop_signals() -> dict[int, Any]:
    """SIGTERM raises Terminated and SIGINT KeyboardInterrupt in the main thread, so a run or a
    server stops cleanly on either, also when it was started with SIGINT ignored (a shell's
    background job, `nohup`), where Python would leave Ctrl-C and `kill -INT` without effect
    (seen: a serve-policy started from a background job kept serving after SIGINT). Returns
    the previous handlers for restore_signals; none off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signal.SIGTERM: signal.signal(signal.SIGTERM, _terminated),
            signal.SIGINT: signal.signal(signal.SIGINT, _interrupted)}


def restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def no_extra_args(ns: argparse.Namespace) -> None:
    if ns.args:
        raise ConfigError(f"tidal {ns.command}: unexpected arguments {' '.join(ns.args)}")
