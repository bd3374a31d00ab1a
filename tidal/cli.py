"""`tidal train | eval | build-default-model`.

    tidal train [CONFIG.yaml ...] [section.key=value ...] [--resume | --overwrite]
    tidal eval MODEL_OR_CHECKPOINT [CONFIG.yaml] [section.key=value ...] [--json]
    tidal config [SECTION_OR_KEY ...] [--markdown]
    tidal build-default-model [--out DIR] [--seed N]
    tidal build-tool-model [--out DIR] [--seed N] [--threads N]
    tidal build-general-tool-model --out DIR [--seed N] [--steps N] [--tune-steps N] [--threads N]
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
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tidal.config import ConfigError, TidalConfig, load_config, load_resume_config, parse_overrides
from tidal.config_doc import render_markdown, render_text, select
from tidal.durable import disk_error
from tidal.envs.dataset import DatasetError
from tidal.launch.slurm import (
    SlurmJob,
    check_nodes,
    default_run_dir,
    node_resources,
    plan_nodes,
    prepare,
    render,
    submit,
)
from tidal.models import (
    BROWSER_MODEL_DIR,
    DEFAULT_MODEL_DIR,
    DEFAULT_VLM_DIR,
    MOE_MODEL_DIR,
    TOOL_MODEL_DIR,
    ModelLoadError,
)
from tidal.monitor.run_status import write_exit
from tidal.net import is_loopback
from tidal.plan.cli import MissingPlanExtra
from tidal.plan.cli import add_parser as add_plan_parser  # imports neither SimPy nor the runtime
from tidal.rewards.pool import RewardLoadError
from tidal.rewards.rm import RewardModelError, RewardModelPool
from tidal.rewards.server import RewardServer, ServeError, check_bind
from tidal.runtime.checkpoints import latest_good
from tidal.runtime.replay import ReplayError, replay
from tidal.runtime.sources import use_kept

# Imported inside the commands that use them, to keep `tidal --help`, `tidal config` and the
# servers' start-up free of them: the runtime (tidal.runtime.controller, assemble, recovery,
# evaluate: transformers, the engines, Ray; seconds), tidal.runtime.run_dir (pyarrow), the
# recipes (model building), the dashboard (its optional extra: duckdb, starlette) and the
# planner's spec (tidal.plan.spec).

USER_ERRORS = (ConfigError, ModelLoadError, DatasetError, RewardLoadError, FileExistsError, FileNotFoundError,
               ReplayError)
RUN_FAILED_EXIT = 3  # the run stopped itself (failure budget); its last checkpoint is intact


def _split_args(args: list[str]) -> tuple[list[str], list[str]]:
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


def _train_config(ns: argparse.Namespace) -> tuple[TidalConfig, dict | None]:
    """The config of `tidal train` (for --resume the run's own, the overrides on top, and the record of them)."""
    config, overrides = _split_args(ns.args)
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
    previous = _catch_stop_signals()
    try:
        ctl = Controller(cfg, resume=ns.resume, resume_record=record, overwrite=ns.overwrite)
    except KeyboardInterrupt as e:  # the controller closed what it had started
        _restore_signals(previous)
        ckpt = latest_good(Path(cfg.run.dir) / "checkpoints") if cfg.run.dir else None
        print(f"tidal: stopped by {'SIGTERM' if isinstance(e, Terminated) else 'an interrupt'} during start-up, "
              f"before any step; " + (f"the last complete checkpoint is {ckpt}" if ckpt else "nothing was trained"),
              file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except BaseException:
        _restore_signals(previous)
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
            _restore_signals(previous)
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
        _restore_signals(previous)
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


def _catch_stop_signals() -> dict[int, Any]:
    """SIGTERM raises Terminated and SIGINT KeyboardInterrupt in the main thread, so a run or a
    server stops cleanly on either, also when it was started with SIGINT ignored (a shell's
    background job, `nohup`), where Python would leave Ctrl-C and `kill -INT` without effect
    (seen: a serve-policy started from a background job kept serving after SIGINT). Returns
    the previous handlers for _restore_signals; none off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signal.SIGTERM: signal.signal(signal.SIGTERM, _terminated),
            signal.SIGINT: signal.signal(signal.SIGINT, _interrupted)}


def _restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


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

    config, overrides = _split_args(ns.args)
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


def cmd_launch_slurm(ns: argparse.Namespace) -> int:
    """Write an sbatch script that runs a Ray cluster and `tidal train` on it; submit it (tidal/launch/slurm.py)."""
    config, overrides = _split_args(ns.args)
    cfg = load_config(config, [*overrides, "placement.mode=ray"])  # validated before anything is written
    trainer_nodes, engine_nodes = plan_nodes(cfg, ns.gpus_per_node)
    nodes = ns.nodes or trainer_nodes + engine_nodes
    check_nodes(cfg, nodes, ns.gpus_per_node)
    run_dir = default_run_dir(cfg)
    job = SlurmJob(configs=[Path(c).resolve() for c in config], overrides=overrides, run_dir=run_dir,
                   nodes=nodes, trainer_nodes=trainer_nodes, gpus_per_node=ns.gpus_per_node, partition=ns.partition,
                   time=ns.time, job_name=f"tidal-{cfg.run.name}", node_resources=node_resources(cfg, nodes, trainer_nodes))
    if ns.dry_run:
        print(render(job), end="")
        return 0
    script = prepare(job)
    job_id = submit(script)
    print(f"tidal: submitted Slurm job {job_id}: {nodes} node(s), run directory {run_dir}\n"
          f"  follow it: squeue -j {job_id}; tail -f {run_dir}/slurm-{job_id}.out; stop it: scancel {job_id}",
          file=sys.stderr)
    print(json.dumps({"job_id": job_id, "run_dir": str(run_dir), "script": str(script), "nodes": nodes}))
    return 0


def cmd_launch_k8s(ns: argparse.Namespace) -> int:
    """Print (or write) KubeRay manifests for the run: a ConfigMap and a RayJob or RayCluster (tidal/launch/k8s.py)."""
    from importlib.metadata import version

    from tidal.launch.k8s import K8sJob, manifests, parse_selector, render

    config, overrides = _split_args(ns.args)
    cfg = load_config(config, [*overrides, "placement.mode=ray"])
    job = K8sJob(name=ns.name or f"tidal-{cfg.run.name}", image=ns.image, kind=ns.kind, gpus_per_node=ns.gpus_per_node,
                 cpus_per_node=ns.cpus_per_node, memory=ns.memory, nodes=ns.nodes, namespace=ns.namespace,
                 volume_claim=ns.volume_claim, run_root=ns.run_root, node_selector=parse_selector(ns.node_selector),
                 ray_version=version("ray"))
    text = render(manifests(cfg, job))
    if ns.out:
        Path(ns.out).write_text(text)
        print(f"tidal: wrote {ns.out}; start it with: kubectl apply -f {ns.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def cmd_replay(ns: argparse.Namespace) -> int:
    """Run one recorded episode again and say whether it reproduces (tidal/runtime/replay.py)."""
    res = replay(ns.run_dir, ns.episode_id, ns.checkpoint)
    print(json.dumps(res.to_dict()) if ns.json else res.summary())
    return 0 if res.reproduced else 1


def cmd_build(ns: argparse.Namespace) -> int:
    from tidal.recipes.tiny import build_default_model

    summary = build_default_model(ns.out, seed=ns.seed)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    return 0


def _build(ns: argparse.Namespace, build, drop: tuple[str, ...] = ("history",), **kwargs) -> int:
    """A `tidal build-*` command: `build(ns.out, seed=ns.seed, **kwargs)` on `ns.threads` torch
    threads (the shipped builds record theirs), its summary printed as JSON without `drop`."""
    _no_extra_args(ns)
    torch.set_num_threads(ns.threads)
    summary = build(ns.out, seed=ns.seed, **kwargs)
    print(json.dumps({k: v for k, v in summary.items() if k not in drop}))
    return 0


def cmd_build_tool(ns: argparse.Namespace) -> int:
    from tidal.recipes.tool_model import build_tool_model

    return _build(ns, build_tool_model)


def cmd_build_general_tool(ns: argparse.Namespace) -> int:
    from tidal.recipes.general_tool_model import build_general_tool_model

    return _build(ns, build_general_tool_model, ("history", "losses", "tune"), steps=ns.steps,
                  tune_steps=ns.tune_steps)


def cmd_build_browser(ns: argparse.Namespace) -> int:
    from tidal.recipes.browser_model import build_browser_model

    return _build(ns, build_browser_model)


def cmd_build_vlm(ns: argparse.Namespace) -> int:
    from tidal.recipes.vlm_build import build_default_vlm

    return _build(ns, build_default_vlm, ())


def cmd_build_moe(ns: argparse.Namespace) -> int:
    from tidal.recipes.moe_model import build_default_moe

    return _build(ns, build_default_moe)


def _no_extra_args(ns: argparse.Namespace) -> None:
    if ns.args:
        raise ConfigError(f"tidal {ns.command}: unexpected arguments {' '.join(ns.args)}")


def cmd_train_rm(ns: argparse.Namespace) -> int:
    from tidal.recipes.train_rm import train_reward_model

    _no_extra_args(ns)
    try:
        summary = train_reward_model(ns.out, init=ns.init, pairs=ns.pairs, steps=ns.steps, batch_size=ns.batch_size,
                                     lr=ns.lr, seed=ns.seed, heldout_pairs=ns.heldout_pairs, threads=ns.threads,
                                     log=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"tidal: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": ns.out, "heldout_pairwise_accuracy": summary["heldout"]["accuracy"],
                      "heldout_pairwise_accuracy_eos": summary["heldout"]["accuracy_eos"],
                      "by_kind": summary["heldout"]["by_kind"], "heldout_at_init": summary["heldout_at_init"],
                      "wall_s": summary["wall_s"]}))
    return 0


def cmd_serve_rm(ns: argparse.Namespace) -> int:
    _no_extra_args(ns)
    token = ns.token
    if ns.token_env:
        token = os.environ.get(ns.token_env)
        if not token:
            print(f"tidal: error: --token-env {ns.token_env}: the environment variable is not set", file=sys.stderr)
            return 2
    try:
        check_bind(ns.host, token)  # before the model loads: a refused start costs nothing
        pool = RewardModelPool(ns.model, max_batch_size=ns.max_batch_size, max_wait_ms=ns.max_wait_ms,
                               device=ns.device, dtype=ns.dtype, threads=ns.threads)
        server = RewardServer(pool, ns.host, ns.port, token, transform=ns.transform, log_level=ns.log_level)
    except (ServeError, RewardModelError) as e:
        print(f"tidal: error: {e}", file=sys.stderr)
        return 2
    print(f"tidal: reward model {ns.model} on {server.url} (POST /score, POST /get_reward, GET /health"
          f"{'; token required' if token else ''})", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        pool.close()
    return 0


def cmd_serve_policy(ns: argparse.Namespace) -> int:
    """An OpenAI-compatible server over a model or checkpoint (tidal/runtime/gateway.py)."""
    from tidal.runtime.assemble import build_run

    config, overrides = _split_args(ns.args)
    flags = [f"gateway.host={ns.host}"] if ns.host else []
    flags += [f"gateway.port={ns.port}"] if ns.port is not None else []
    cfg = load_config(config, [*overrides, *flags])
    if ns.token_env:
        token = os.environ.get(ns.token_env)
        if not token:
            print(f"tidal: error: --token-env {ns.token_env}: the environment variable is not set", file=sys.stderr)
            return 2
        cfg.gateway.token = token
    if not is_loopback(cfg.gateway.host) and not cfg.gateway.token:
        print(f"tidal: error: --host {cfg.gateway.host} is not loopback: give the clients' token with --token-env",
              file=sys.stderr)
        return 2
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    run = build_run(cfg, "serve", model=ns.model)
    server, engines, kind = run.gateway, run.engines, run.engine_kind
    print(f"tidal: serving {run.model_dir} as `{server.gateway.model_name}` on {server.url} ({len(engines)} {kind} "
          f"replica(s): {run.engine_why}; POST /v1/chat/completions, /v1/completions, GET /v1/models"
          f"{'; token required' if server.token else ''})", file=sys.stderr, flush=True)
    stop = threading.Event()
    previous = _catch_stop_signals()  # SIGINT or SIGTERM: close the server and the engines, exit 0
    try:
        while server.thread.is_alive() and not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        _restore_signals(previous)
        run.close()  # the server, then the engines
    return 0


def cmd_dashboard(ns: argparse.Namespace) -> int:
    """A web page over run directories (tidal/monitor/dashboard): curves, episodes, config diff."""
    from tidal.monitor.dashboard.data import DashboardError
    from tidal.monitor.dashboard.server import DashboardServer, MissingDashboardExtra
    token = None
    if ns.token_env:
        token = os.environ.get(ns.token_env)
        if not token:
            print(f"tidal: error: --token-env {ns.token_env}: the environment variable is not set", file=sys.stderr)
            return 2
    elif not is_loopback(ns.host):
        token = secrets.token_urlsafe(24)  # off loopback never without one; printed once, in the address below
    try:
        server = DashboardServer(ns.run_dirs + ns.args, ns.host, ns.port, token)
    except (DashboardError, MissingDashboardExtra) as e:
        print(f"tidal: error: {e}", file=sys.stderr)
        return 2
    address = server.url + (f"?token={token}" if token and not ns.token_env else "")
    print(f"tidal: dashboard of {len(server.runs)} run(s) on {address}" + (" (token required)" if token else ""),
          file=sys.stderr, flush=True)
    previous = _catch_stop_signals()
    try:
        while server.thread.is_alive():
            server.thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        _restore_signals(previous)
        server.close()
    return 0


def _stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's stack on stderr (a run or a server that seems
    stuck says where), and it goes on. Only from the main thread, where signals can be set."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
        try:  # the process's own stderr (a caller may have replaced sys.stderr with one that has no descriptor)
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True, chain=False)
        except (AttributeError, ValueError, OSError):
            pass  # no stderr descriptor at all: nothing to print the stacks on


def _plan_errors() -> tuple[type[Exception], ...]:
    from tidal.plan.spec import PlanSpecError  # yaml schemas of the planner: only when an error is met

    return MissingPlanExtra, PlanSpecError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)
    _run_commands(sub)
    _build_commands(sub)
    _serve_commands(sub)
    _launch_commands(sub)
    add_plan_parser(sub)
    return p


def _launch_commands(sub) -> None:
    la = sub.add_parser("launch", help="run a training job on a cluster's scheduler (docs/clusters.md)")
    lsub = la.add_subparsers(dest="scheduler", required=True)
    s = lsub.add_parser("slurm", help="write and submit an sbatch script: a Ray cluster over the job's nodes, "
                        "`tidal train` on it, the cluster stopped with the job")
    s.add_argument("args", nargs="*", help="CONFIG.yaml and/or section.key=value overrides (as for `tidal train`)")
    s.add_argument("--nodes", type=int, default=None, help="nodes to allocate (default: what the config's trainer "
                   "and engine GPUs need at --gpus-per-node; 1 for a CPU job)")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (#SBATCH --gpus-per-node; Ray's "
                   "--num-gpus); 0: a CPU job")
    s.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    s.add_argument("--time", default=None, help="time limit, as sbatch --time takes it (e.g. 04:00:00)")
    s.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    s.set_defaults(fn=cmd_launch_slurm)
    k = lsub.add_parser("k8s", help="print KubeRay manifests (a ConfigMap and a RayJob or RayCluster) for "
                        "`kubectl apply -f`")
    k.add_argument("args", nargs="*", help="CONFIG.yaml and/or section.key=value overrides (as for `tidal train`)")
    k.add_argument("--image", required=True, help="the container image with tidal installed (every pod runs it)")
    k.add_argument("--kind", default="RayJob", choices=["RayJob", "RayCluster"], help="RayJob (default): the cluster "
                   "lives as long as the run; RayCluster: the cluster alone, the driver started on its head by hand")
    k.add_argument("--name", default=None, help="the resources' name (default: tidal-<run.name>)")
    k.add_argument("--namespace", default=None, help="Kubernetes namespace (default: kubectl's)")
    k.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per worker pod (nvidia.com/gpu); 0: CPU pods")
    k.add_argument("--cpus-per-node", type=int, default=8, help="CPUs per pod (requests = limits)")
    k.add_argument("--memory", default="32Gi", help="memory per pod (requests = limits)")
    k.add_argument("--nodes", type=int, default=None, help="worker pods (default: what the config's roles need)")
    k.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="a node label every worker pod needs (repeatable), e.g. a GPU node pool's")
    k.add_argument("--volume-claim", default="tidal-runs", help="a ReadWriteMany PersistentVolumeClaim every pod "
                   "mounts at --run-root (the run directory, checkpoints)")
    k.add_argument("--run-root", default="/runs", help="where the claim is mounted; run.dir must be under it "
                   "(default run.dir: RUN_ROOT/<run.name>)")
    k.add_argument("--out", default=None, help="write the manifests to this file instead of printing them")
    k.set_defaults(fn=cmd_launch_k8s)


def _run_commands(sub) -> None:
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


def _build_commands(sub) -> None:
    b = sub.add_parser("build-default-model", help="rebuild the embedded tiny model deterministically")
    b.add_argument("--out", default=str(DEFAULT_MODEL_DIR))
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(fn=cmd_build)
    bt = sub.add_parser("build-tool-model", help="rebuild the tiny tool-calling model (tool_arith) deterministically")
    bt.add_argument("--out", default=str(TOOL_MODEL_DIR))
    bt.add_argument("--seed", type=int, default=0)
    bt.add_argument("--threads", type=int, default=1, help="torch threads (the result is deterministic per count)")
    bt.set_defaults(fn=cmd_build_tool, args=[])
    bg = sub.add_parser("build-general-tool-model",
                        help="build a tiny tool model warm-started on generated tools (not shipped: docs/agents.md)")
    bg.add_argument("--out", required=True)
    bg.add_argument("--seed", type=int, default=0)
    bg.add_argument("--steps", type=int, default=2000, help="SFT steps of the first phase (docs/agents.md)")
    bg.add_argument("--tune-steps", type=int, default=1000,
                    help="SFT steps of the second phase, which calls the tool more often (0: none)")
    bg.add_argument("--threads", type=int, default=1, help="torch threads (the result is deterministic per count)")
    bg.set_defaults(fn=cmd_build_general_tool, args=[])
    bb = sub.add_parser("build-browser-model", help="rebuild the tiny browser model (click_button) deterministically")
    bb.add_argument("--out", default=str(BROWSER_MODEL_DIR))
    bb.add_argument("--seed", type=int, default=0)
    bb.add_argument("--threads", type=int, default=2,
                    help="torch threads (the result is deterministic per count; the shipped model: 2)")
    bb.set_defaults(fn=cmd_build_browser, args=[])
    bv = sub.add_parser("build-default-vlm",
                        help="rebuild the embedded tiny vision-language model (image tasks) deterministically")
    bv.add_argument("--out", default=str(DEFAULT_VLM_DIR))
    bv.add_argument("--seed", type=int, default=0)
    bv.add_argument("--threads", type=int, default=2, help="torch threads (the result is deterministic per count)")
    bv.set_defaults(fn=cmd_build_vlm, args=[])
    bm = sub.add_parser("build-moe", help="rebuild the embedded tiny mixture of experts (default-moe) deterministically")
    bm.add_argument("--out", default=str(MOE_MODEL_DIR))
    bm.add_argument("--seed", type=int, default=0)
    bm.add_argument("--threads", type=int, default=1,
                    help="torch threads (the result is deterministic per count; the shipped model: 1)")
    bm.set_defaults(fn=cmd_build_moe, args=[])
    r = sub.add_parser("train-rm", help="train a tiny reward model (Bradley-Terry) on synthetic arithmetic preferences")
    r.add_argument("--out", default="runs/reward-model", help="output HF directory (default: runs/reward-model)")
    r.add_argument("--pairs", type=int, default=4000, help="training pairs, from the task's train split")
    r.add_argument("--steps", type=int, default=400)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--batch-size", type=int, default=32, help="pairs per step")
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--heldout-pairs", type=int, default=500, help="pairs from the held-out split, to measure only")
    r.add_argument("--init", default=None, help="initial weights and tokenizer (default: the embedded tiny model)")
    r.add_argument("--threads", type=int, default=1, help="torch threads (the result is deterministic per count)")
    r.set_defaults(fn=cmd_train_rm, args=[])


def _serve_commands(sub) -> None:
    s = sub.add_parser("serve-rm", help="serve a reward model over HTTP (tidal /score and OpenRLHF /get_reward)")
    s.add_argument("model", help="HF sequence-classification directory (e.g. from tidal train-rm)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind; not loopback only with a token")
    s.add_argument("--port", type=int, default=5000, help="port (0: a free one, printed)")
    s.add_argument("--token", default=None, help="bearer token clients must send (visible in `ps`: prefer --token-env)")
    s.add_argument("--token-env", default=None, help="name of an environment variable holding the token")
    s.add_argument("--max-batch-size", type=int, default=32)
    s.add_argument("--max-wait-ms", type=float, default=5.0)
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    s.add_argument("--transform", choices=["raw", "sigmoid", "standard"], default="raw",
                   help="raw logits, sigmoid, or standardized by the held-out score stats of tidal_rm.json")
    s.add_argument("--log-level", default="warning", help="uvicorn log level")
    s.set_defaults(fn=cmd_serve_rm, args=[])
    rp = sub.add_parser("replay", help="run one recorded episode again and say whether it reproduces")
    rp.add_argument("run_dir", help="the run's directory")
    rp.add_argument("episode_id", help="the episode's id, as in its step's Parquet file (e.g. s12-p3-e5)")
    rp.add_argument("--checkpoint", default=None, help="weights to replay with (default: the run's checkpoint of "
                    "the version that generated the episode)")
    rp.add_argument("--json", action="store_true", help="the report as JSON")
    rp.set_defaults(fn=cmd_replay, args=[])
    sp = sub.add_parser("serve-policy", help="serve a model or checkpoint through an OpenAI-compatible API")
    sp.add_argument("model", help="model directory, checkpoint directory, or 'default'")
    sp.add_argument("args", nargs="*", help="CONFIG.yaml and/or overrides: engine.kind=vllm, engine.replicas=2, "
                                            "gateway.model_name=..., gateway.max_tokens=..., run.threads=...")
    sp.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; elsewhere a token is required)")
    sp.add_argument("--port", type=int, default=None, help="port (default: a free one, printed)")
    sp.add_argument("--token-env", default=None, help="name of an environment variable holding the bearer token")
    sp.set_defaults(fn=cmd_serve_policy)
    d = sub.add_parser("dashboard", help="a web page of runs: curves, episodes, config diff (pip install "
                       "'tidal[dashboard]')")
    d.add_argument("run_dirs", nargs="+", help="run directories (several: curves overlaid, configs compared)")
    d.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; elsewhere a token "
                   "is required: --token-env, or a random one printed in the address)")
    d.add_argument("--port", type=int, default=8765, help="port (0: a free one, printed; default 8765)")
    d.add_argument("--token-env", default=None, help="name of an environment variable holding the token")
    d.set_defaults(fn=cmd_dashboard, args=[])


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
    except (*USER_ERRORS, *_plan_errors()) as err:
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


if __name__ == "__main__":
    sys.exit(main())
