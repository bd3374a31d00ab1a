"""`tidal train`, `tidal eval` and `tidal config`: the commands that run the library on a
config, and the reference of that config.

`train` catches SIGTERM as Ctrl-C from its start, so that a scheduler's stop leaves the last
complete checkpoint and says how to resume; how the run ended goes into RUN/exit.json. The
runtime (transformers, the engines, Ray) is imported inside the commands that use it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tidal.cli.common import (
    RUN_FAILED_EXIT,
    USER_ERRORS,
    Terminated,
    catch_stop_signals,
    restore_signals,
    split_args,
)
from tidal.config import ConfigError, TidalConfig, load_config, load_resume_config, parse_overrides
from tidal.config.doc import render_markdown, render_text, select
from tidal.durable import disk_error
from tidal.monitor.run_status import write_exit
from tidal.runtime.checkpoints import latest_good
from tidal.runtime.sources import use_kept


def _train_config(ns: argparse.Namespace) -> tuple[TidalConfig, dict | None]:
    """The config of `tidal train` (for --resume the run's own, the overrides on top, and the record of them)."""
    config, overrides = split_args(ns.args)
    if ns.resume and ns.overwrite:
        raise ConfigError("--resume continues the run in run.dir and --overwrite deletes it: give one of them")
    if not ns.resume:
        return load_config(config, overrides), None
    if config:
        raise ConfigError(f"--resume continues with the run's own config.yaml: give overrides only "
                          f"(section.key=value), not {' '.join(config)}")
    run_dir = (parse_overrides(overrides).get("run") or {}).get("dir")
    if not run_dir:
        raise ConfigError("--resume needs run.dir=RUN_DIR: the directory of the run to continue")
    cfg, record = load_resume_config(run_dir, [o for o in overrides if not o.startswith("run.dir=")])
    cfg.run.dir = str(run_dir)
    return cfg, record


def _say_resume(ctl, cfg: TidalConfig, record: dict) -> None:
    start = f"from checkpoint {ctl.resumed_from}" if ctl.resumed_from is not None else \
        "from the start (it stopped before its first checkpoint)"
    print(f"tidal: resuming {ctl.paths.root} {start} (step {ctl.step} of train.steps={cfg.train.steps})",
          file=sys.stderr)
    for key, (old, new) in record["changed"].items():
        note = "  (changes what the resumed steps compute)" if key in record["changes_computation"] else ""
        print(f"tidal:   {key}: {old!r} -> {new!r}{note}", file=sys.stderr)


def cmd_train(ns: argparse.Namespace) -> int:
    from tidal.runtime.controller import Controller  # transformers, the engines, Ray: only for a command that trains

    cfg, record = _train_config(ns)
    if cfg.placement.mode == "launcher":  # one process per rank: rank 0 goes on as the controller
        cfg, rank_exit = _launched_rank(cfg)
        if rank_exit is not None:
            return rank_exit
    # SIGTERM (a scheduler's stop, `kill`) ends the run as Ctrl-C does, from the start on: the
    # step in flight is abandoned, roles are closed, the last complete checkpoint stays (exit 143).
    previous = catch_stop_signals()
    try:
        ctl = Controller(cfg, resume=ns.resume, resume_record=record, overwrite=ns.overwrite)
    except KeyboardInterrupt as e:  # the controller closed what it had started
        restore_signals(previous)
        ckpt = latest_good(Path(cfg.run.dir) / "checkpoints") if cfg.run.dir else None
        print(f"tidal: stopped by {'SIGTERM' if isinstance(e, Terminated) else 'an interrupt'} during start-up, "
              f"before any step; " + (f"the last complete checkpoint is {ckpt}" if ckpt else "nothing was trained"),
              file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except BaseException:
        restore_signals(previous)
        raise
    try:  # how it ended, in RUN/exit.json, for the dashboard (tidal/monitor/run_status.py)
        code = _train_run(ns, cfg, record, ctl, previous)
    except BaseException as e:
        write_exit(ctl.paths.root, _exit_code_of(e), f"{type(e).__name__}: {e}")
        raise
    write_exit(ctl.paths.root, code)
    return code


def _exit_code_of(err: BaseException) -> int:
    """The exit code `main` gives for an error that ends `tidal train`."""
    from tidal.runtime.run_dir import RunFailed  # pyarrow

    if isinstance(err, KeyboardInterrupt):
        return 130
    if isinstance(err, RunFailed) or (isinstance(err, Exception) and disk_error(err) is not None):
        return RUN_FAILED_EXIT
    return 2 if isinstance(err, USER_ERRORS) else 1


def _train_run(ns: argparse.Namespace, cfg: TidalConfig, record: dict | None, ctl, previous: dict[int, Any]) -> int:
    """The run once its controller has started: the steps, and what is said when they end."""
    from tidal.runtime.controller import Controller
    from tidal.runtime.recovery import Recovering

    if ns.resume:
        _say_resume(ctl, cfg, record)
        if ctl.step >= cfg.train.steps:
            restore_signals(previous)
            ctl.close()
            print(f"tidal: nothing to do: the run is at step {ctl.step} of train.steps={cfg.train.steps} "
                  f"(give train.steps=N with N > {ctl.step} to go on)", file=sys.stderr)
            return 0
    print(f"tidal: run directory {ctl.paths.root}  (model {ctl.model_dir}, {cfg.rollout.prompts_per_step}×"
          f"{cfg.rollout.samples_per_prompt} episodes per step, {cfg.train.steps} steps; engine {ctl.engine_choice})",
          file=sys.stderr)
    t0 = time.time()
    # A lost trainer rank restarts the roles from the last checkpoint (run.max_restarts).
    runner = Recovering(ctl, lambda rec: Controller(cfg, resume=True, resume_record=rec))
    try:
        last = runner.train()
        ctl = runner.ctl
    except KeyboardInterrupt as e:
        ckpt = ctl.paths.latest_checkpoint()
        how = "SIGTERM" if isinstance(e, Terminated) else "an interrupt"
        step = runner.ctl.step + 1 if runner.ctl is not None else "(restarting)"
        print(f"tidal: stopped by {how} during step {step}; the last complete checkpoint is "
              f"{ckpt or 'none (no step was saved yet)'} (continue with: tidal train --resume run.dir={ctl.paths.root})",
              file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        restore_signals(previous)
        if runner.ctl is not None:
            runner.ctl.close()
    if ctl.disk_error is not None:  # the run's last write (closing its trace) met a full disk
        raise ctl.disk_error
    print(json.dumps({"run_dir": str(ctl.paths.root), "step": ctl.step, "wall_s": round(time.time() - t0, 1),
                      "reward": last.get("reward"), "accuracy": last.get("accuracy")}))
    return 0


def _launched_rank(cfg: TidalConfig) -> tuple[TidalConfig, int | None]:
    """placement.mode=launcher: the config fitted to the launcher's world size, and for a rank
    other than 0 its exit code once it has served rank 0 (tidal/runtime/launcher.py)."""
    import logging
    import os

    import torch

    from tidal.runtime.launcher import config_for, serve_rank
    from tidal.runtime.ranks import detect

    env = detect(os.environ)
    cfg = config_for(cfg, env)
    if torch.cuda.is_available():  # one GPU per rank, by its rank on the node
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    if env.is_controller:
        return cfg, None
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    logging.basicConfig(level=logging.INFO, format=f"rank {env.rank}: %(levelname)s %(message)s")
    return cfg, serve_rank(cfg, env)


def _config_for_model(model: str, config: list[str], overrides: list[str]) -> TidalConfig:
    """A checkpoint evaluates on the task of its own run unless a config is given (a run's own
    config.yaml given as the one config counts as the run's)."""
    if len(config) == 1 and Path(config[0]).name == "config.yaml" and (Path(config[0]).parent / "sources.json").is_file():
        return use_kept(load_config(config, overrides), Path(config[0]).parent, "eval")
    if config:
        return load_config(config, overrides)
    for parent in [Path(model), *Path(model).parents][:4]:
        if (parent / "config.yaml").is_file() and (parent / "metrics.jsonl").exists():
            # the run's own copies of its files of code (tidal/runtime/sources.py), said when the originals changed
            return use_kept(load_config(parent / "config.yaml", overrides), parent, "eval")
    return load_config(None, overrides)


def cmd_eval(ns: argparse.Namespace) -> int:
    from tidal.runtime.assemble import build_run
    from tidal.runtime.evaluate import evaluate_engine

    config, overrides = split_args(ns.args)
    cfg = _config_for_model(ns.model, config, overrides)
    run = build_run(cfg, "eval", model=ns.model)  # the engine `engine.kind` names, as the run's rollout would
    model_dir, kind = run.model_dir, run.engine_kind
    try:  # whatever fails from here, the engine (a vLLM process or server) is closed
        t0 = time.time()  # wall_s: the evaluation (not the engine's or the scorer's start)
        res = evaluate_engine(run.engine, run.rollout, run.task.eval_rows[: cfg.eval.n], run.make_env, k=cfg.eval.k,
                              temperature=cfg.eval.temperature)
    finally:
        run.close()
    res = {"model": str(model_dir), "engine": kind, **res, "wall_s": round(time.time() - t0, 1)}
    if ns.json:
        print(json.dumps(res))
    elif res["accuracy"] is None and not res["failed"]:
        print(f"{model_dir}: no reward of this task says what is correct (no `correct` part, no reward named "
              f"`correct`, no veRL `acc`): set eval.reward (and eval.reward_form) to a verifier, e.g. "
              f"eval.reward=tidal.rewards.arithmetic:score")
    else:
        failed = ", ".join(f"{n} {s}" for s, n in sorted(res["failed_by_status"].items())) or "none"
        tools = f"  tool-call error rate {res['tool_error_rate']:.3f}" if "tool_error_rate" in res else ""
        num = lambda x: "n/a" if x is None else f"{x:.3f}"  # nothing was scored: unknown, not 0
        print(f"{model_dir}: held-out accuracy (greedy) {num(res['accuracy'])}  pass@{res['k']} "
              f"{num(res['pass_at_k'])}  pass@1 (T={res['temperature']}) {num(res['pass_at_1'])}  on {res['n']} "
              f"problems, {res['scored']} scored  (failed episodes {res['failed_frac']:.1%}, left out of the "
              f"accuracy: {failed}){tools}")
        if res.get("first_error"):
            print(f"  first failure: {res['first_error']}")
    return 0


def cmd_config(ns: argparse.Namespace) -> int:
    """Every config key (or those of the sections named) with its type, default and description."""
    if ns.markdown:
        if ns.keys:
            raise ConfigError("tidal config --markdown prints the whole reference (docs/config.md): give no keys")
        print(render_markdown(), end="")
        return 0
    try:
        docs = select(ns.keys)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(render_text(docs), end="")
    return 0


def add_parsers(sub) -> None:
    t = sub.add_parser("train", help="train a policy with RL")
    t.add_argument("args", nargs="*", help="CONFIG.yaml files (merged in order, later ones winning) and/or "
                   "section.key=value overrides (applied last)")
    t.add_argument("--resume", action="store_true", help="continue the run in run.dir from its latest checkpoint "
                   "(from its start when it stopped before the first)")
    t.add_argument("--overwrite", action="store_true", help="start a new run in run.dir even though an earlier run "
                   "is there: its files (checkpoints, episodes, metrics, logs; every entry of the directory) are "
                   "deleted first, each named")
    t.set_defaults(fn=cmd_train)
    e = sub.add_parser("eval", help="held-out accuracy and pass@k of a model or checkpoint")
    e.add_argument("model", help="model directory, checkpoint directory, or 'default'")
    e.add_argument("args", nargs="*", help="CONFIG.yaml and/or section.key=value overrides (eval.n, eval.k, ...)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=cmd_eval)
    c = sub.add_parser("config", help="every config key with its type, default and description (docs/config.md)")
    c.add_argument("keys", nargs="*", help="sections or keys to show (e.g. rollout, train.lora); default: all")
    c.add_argument("--markdown", action="store_true", help="the whole reference as Markdown (docs/config.md)")
    c.set_defaults(fn=cmd_config, args=[])
