"""The `tidal` command.

    tidal train [CONFIG.yaml ...] [section.key=value ...] [--resume | --overwrite]
    tidal eval MODEL_OR_CHECKPOINT [CONFIG.yaml] [section.key=value ...] [--json]
    tidal config [SECTION_OR_KEY ...] [--markdown]
    tidal build-default-model [--out DIR] [--seed N]
    tidal build-tool-model [--out DIR] [--seed N] [--threads N]
    tidal build-general-tool-model [--out DIR] [--seed N] [--steps N] [--tune-steps N] [--threads N]
    tidal build-browser-model [--out DIR] [--seed N] [--threads N]
    tidal build-default-vlm [--out DIR] [--seed N] [--threads N]
    tidal build-moe [--out DIR] [--seed N] [--threads N]
    tidal train-rm [--out DIR] [--pairs N] [--steps N] [--seed N]
    tidal serve-rm MODEL_DIR [--host 127.0.0.1] [--port N] [--token-env NAME | --token T]
    tidal serve-policy MODEL_OR_CHECKPOINT [section.key=value ...] [--host H] [--port N] [--token-env NAME]
    tidal dashboard RUN_DIR [RUN_DIR ...] [--host H] [--port N] [--token-env NAME]
    tidal launch slurm [CONFIG.yaml] [section.key=value ...] [--nodes N] [--gpus-per-node G] [--partition P]
                       [--time T] [--dry-run]
    tidal launch k8s [CONFIG.yaml] [section.key=value ...] --image IMAGE [--kind RayJob|RayCluster] [--gpus-per-node G]
                     [--node-selector K=V ...] [--volume-claim PVC] [--run-root DIR] [--out FILE]
    tidal plan SPEC.yaml [--simulate] [--explain] [--out DIR] | tidal plan calibrate RUN_DIR

Errors a person can act on are printed as one message (no traceback) with exit code 2.
The commands live in the modules of this package, each with its parser: train.py (train, eval,
config), build.py (build-*, train-rm), serve.py (serve-rm, serve-policy, dashboard, replay),
cluster.py (launch, plan); common.py holds what they share.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import threading
from pathlib import Path

from tidal.cli import build, cluster, serve, train
from tidal.cli.common import RUN_FAILED_EXIT, USER_ERRORS
from tidal.durable import disk_error

# Imported inside the commands that use them, to keep `tidal --help`, `tidal config` and the
# servers' start-up free of them: the runtime (tidal.runtime.controller, assemble, recovery,
# evaluate: transformers, the engines, Ray; seconds), tidal.runtime.run_dir (pyarrow), the
# recipes (model building), the dashboard (its optional extra: duckdb, starlette) and the
# planner's spec (tidal.plan.spec).


def _stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's stack on stderr (a run or a server that seems
    stuck says where), and it goes on. Only from the main thread, where signals can be set."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
        try:  # the process's own stderr (a caller may have replaced sys.stderr with one that has no descriptor)
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True, chain=False)
        except (AttributeError, ValueError, OSError):
            pass  # no stderr descriptor at all: nothing to print the stacks on


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)
    train.add_parsers(sub)
    build.add_parsers(sub)
    serve.add_parsers(sub)
    cluster.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    # Options may come before, between or after the overrides (`train a=1 --resume b=2`).
    ns, rest = p.parse_known_args(argv)
    if any(r.startswith("-") for r in rest):
        p.error(f"unrecognized arguments: {' '.join(r for r in rest if r.startswith('-'))}")
    ns.args = [*ns.args, *rest]
    _stacks_on_sigusr1()
    try:
        return ns.fn(ns)
    except (*USER_ERRORS, *cluster.plan_errors()) as err:
        print(f"tidal: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        from tidal.runtime.run_dir import RunFailed  # pyarrow: only when a run failed

        if isinstance(err, RunFailed):
            print(f"tidal: run stopped: {err}", file=sys.stderr)
            return RUN_FAILED_EXIT
        cause = disk_error(err)  # a full disk before the first step (config.yaml, train.log)
        if cause is None:
            raise
        from tidal.runtime.run_dir import free_space

        where = cause.filename or "the run directory"
        room = f", {free_space(Path(cause.filename).parent)}" if cause.filename else ""
        print(f"tidal: run stopped: could not write {where} ({cause.strerror}{room}); nothing was trained",
              file=sys.stderr)
        return RUN_FAILED_EXIT
    except KeyboardInterrupt:
        print("tidal: interrupted; the last complete checkpoint is intact (resume with --resume)", file=sys.stderr)
        return 130
