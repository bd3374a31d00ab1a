"""The controller: assembles a run (assemble.py) and runs the RL loop over its roles.

A step is two parts. `_produce` samples: prompts → rollout (generate, environment, reward),
with DAPO's refill. `_learn` learns from it in named stages, in this order:

    prepare    failed episodes and the failure budget (health.py), the step's episode
               metrics, advantages and the batch (batch.py)
    update     forward/backward and optimizer steps over the mini-batches (the trainer's
               `update`, trainer_group.py)
    publish    the new weights to the engines (sync.py)
    observe    timings, held-out evaluation, monitors and alerts (health.py), the metrics,
               samples and episodes written
    health     a stop on non-finite steps or an alert of alerts.stop_on (health.py)
    checkpoint the step saved when due, healthy, or the best so far

`train_step` runs the two parts one after the other on the calling thread. `train` is
`train_step` in a plain loop at `rollout.max_staleness` k=0 (a debugger steps through a
step from top to bottom); only for k>0 does a producer thread roll out ahead, admitted by
weight version and joined to this thread by a bounded queue (ahead_loop.py). The controller
owns no tensors beyond what it passes between roles.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.algorithms import ESTIMATORS, AdaptiveKLController, build_estimator, needs
from tidal.config import TidalConfig, dump_config
from tidal.durable import append_lines, disk_error, write_atomic
from tidal.envs import loop_scoped
from tidal.envs.dataset import PromptSource
from tidal.importing import import_object
from tidal.monitor import trace
from tidal.monitor.alerts import AlertEvent
from tidal.monitor.episodes import EpisodeWriter
from tidal.monitor.progress import Progress
from tidal.monitor.run_log import RunLog
from tidal.monitor.run_status import clear_exit
from tidal.monitor.samples import sample_table
from tidal.monitor.sinks import open_sinks
from tidal.monitor.step_metrics import episode_metrics, staleness_metrics
from tidal.runtime import inflight, sources
from tidal.runtime.ahead_loop import Overlap, train_ahead
from tidal.runtime.assemble import build_run
from tidal.runtime.batch import build_batch, informative, shape_rewards
from tidal.runtime.checkpoints import RunPaths, file_system_error, prune, read_best, write_best, write_manifest
from tidal.runtime.evaluate import evaluate_during_training
from tidal.runtime.health import Health
from tidal.runtime.rollout import group_specs
from tidal.runtime.run_dir import DiskError, RunFailed, clear_run, disk_failure, free_space, tidy_for_resume
from tidal.runtime.run_lock import RunLock
from tidal.trainer.threads import on_own_thread
from tidal.types import Episode

log = logging.getLogger("tidal")
__all__ = ["Controller", "DiskError", "RunFailed", "Sampled"]


def write_json(path: Path, obj) -> None:
    """Write through a temporary file and rename: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


@dataclass
class Sampled:
    """A step's rollout, handed from the rollout stage to the learning stage."""

    step: int
    episodes: list[Episode]  # every sampled episode
    train_eps: list[Episode]  # those to train on
    baselines: dict[str, float]  # greedy reward per group (estimators that need a greedy baseline)
    metrics: dict[str, float]
    t_start: float
    t_end: float
    admission_wait: float = 0.0  # time the rollout waited for fresh enough weights


class Controller:
    def __init__(self, cfg: TidalConfig, resume: bool = False, resume_record: dict | None = None,
                 overwrite: bool = False):
        """`resume`: continue the run in cfg.run.dir from its newest good checkpoint (from its start
        when it has none); `resume_record` (the overrides and config changes of this resume, from
        config.load_resume_config) is appended to the run's resumes.jsonl. `overwrite`: a new run
        into the directory of an earlier one, whose files are removed first (run_dir.clear_run)."""
        self.cfg = cfg
        self._overwrite = overwrite
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        torch.manual_seed(cfg.run.seed)
        run_dir = Path(cfg.run.dir or f"runs/{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.paths = RunPaths(run_dir)
        # One run per directory, from before its first write (in `_open`, once the inputs are
        # checked) to close() (tidal/runtime/run_lock.py).
        self.run_lock = RunLock(run_dir)
        self.disk_error: DiskError | None = None  # a disk error met while closing (close() does not raise it)
        self.parts = self.run_log = self.resumed_from = None
        self._learning: int | None = None  # the step being learned (named by a write that fails in it)
        try:
            self._start(resume, resume_record)
        except BaseException:  # whatever stopped the start (an error, SIGTERM): nothing it began outlives it
            self.close()
            raise

    def _start(self, resume: bool, resume_record: dict | None) -> None:
        cfg, run_dir = self.cfg, self.paths.root
        # Inputs are checked before anything is created or loaded (model, tokenizer, data,
        # reward); the run directory opens just before the roles start.
        parts = build_run(cfg, "train", run_dir=run_dir, before_roles=lambda: self._open(resume, resume_record))
        self.parts = parts
        log.info("engine: %s (%s)", parts.engine_kind, parts.engine_why)
        self.engine_choice = f"{parts.engine_kind} ({parts.engine_why})"
        self.model_dir, self.tokenizer, self.vision, self.task = parts.model_dir, parts.tokenizer, parts.vision, parts.task
        self.roles, self.make_env, self.params = parts.roles, parts.make_env, parts.params
        self.trainer, self.engine, self.pusher = self.roles.trainer, self.roles.engine, self.roles.pusher
        self.scorer, self.rollout, self.gateway = parts.scorer, parts.rollout, parts.gateway
        self.eval_scorer, self.eval_rollout, self.eval_sets = parts.eval_scorer, parts.eval_rollout, parts.eval_sets
        self.source = PromptSource(self.task.train_rows, seed=cfg.run.seed)
        self.estimator = build_estimator(cfg.algorithm, import_object)  # algorithm.advantage: what it needs
        self.kl_ctl = AdaptiveKLController(cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon)
        self.health = Health(cfg, run_dir, self.paths.latest_checkpoint, self.roles)
        self.step = 0
        self.updates_per_step = cfg.train.epochs * cfg.train.mini_batches  # trainer versions per step
        self._source_lock = threading.Lock()
        self._source_before: dict[int, dict] = {}  # step → data position before its prompts were taken
        self._overlap = Overlap()  # when the producer was rolling out (k > 0)
        self._last_learn_end = self._t_start = time.perf_counter()
        self._ahead = inflight.Ahead()  # steps rolled out ahead of the learner (tidal/runtime/inflight.py)
        self._restored: dict[int, Sampled] = {}  # steps a checkpoint kept ahead, trained as they were
        if self.resumed_from is not None:
            self._load(self.resumed_from)
        # A resume with no checkpoint starts again from step 0: the earlier attempt's metrics all go (-1).
        resume_step = (self.step if self.resumed_from is not None else -1) if resume else None
        self.metrics = open_sinks(cfg, run_dir, resume_step, cfg.model_dump(mode="json"),
                                  self.run_log.file)
        self.episode_writer = EpisodeWriter(run_dir / "episodes", self.tokenizer) if cfg.run.write_episodes else None
        if resume:  # recorded once the resume has started: a resume that failed to start adds no line
            append_lines(run_dir / "resumes.jsonl", [json.dumps({
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "checkpoint": str(self.resumed_from),
                **(resume_record or {})}) + "\n"])

    def _open(self, resume: bool, resume_record: dict | None) -> None:
        """The run directory: checked (a new run does not overwrite one, a resume has a checkpoint),
        its config.yaml and train.log, and what an earlier attempt left past the checkpoint
        (resumes.jsonl gets its line once the start has succeeded)."""
        run_dir, cfg = self.paths.root, self.cfg
        self.run_lock.acquire()  # a second run, or a resume of a live one, is refused here by name
        clear_exit(run_dir)  # an earlier attempt's exit record: this one is running (tidal/monitor/run_status.py)
        resume_from = self.paths.latest_checkpoint() if resume else None
        if resume and resume_from is None:  # stopped before its first checkpoint: it starts again
            log.warning("--resume: %s has no complete checkpoint (the run stopped before its first save): it "
                        "starts again from step 0, with its own config", self.paths.checkpoints)
        if self._overwrite:  # after the lock: a live run's directory is never cleared
            clear_run(run_dir)
        elif not resume and (run_dir / "metrics.jsonl").exists():
            raise FileExistsError(f"run directory {run_dir} already holds a run: pass --resume to continue it, "
                                  "--overwrite to delete it and start again, or choose another run.dir")
        self.resumed_from = resume_from
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (resume and (run_dir / "config.yaml").is_file()):  # a resumed run keeps its own record
            saved = sources.absolute(cfg)  # eval and replay of the run work from any directory
            write_atomic(run_dir / "config.yaml", dump_config(saved))
            sources.keep_sources(saved, run_dir)  # its files of code, as they are now (tidal/runtime/sources.py)
        else:
            sources.warn_changed(run_dir, "--resume")
        self.run_log = RunLog(run_dir / "train.log")  # train.log (tidal/monitor/run_log.py)
        if resume:  # what an earlier attempt left past the checkpoint (past step 0 without one)
            tidy_for_resume(run_dir, json.loads((resume_from / "controller.json").read_text())["step"]
                            if resume_from is not None else 0)
        if cfg.run.trace:  # before the roles start: a trainer in this process records into the driver's track
            trace.enable("driver")

    # -- the step ---------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One synchronous step on this thread: sample, then learn from it."""
        try:
            sampled = self._produce(self.step + 1)
            # The learning stages build tensors (the batch, advantages, metrics) with parallel torch
            # ops: on a thread that ends with them, so that no OpenMP team stays on this thread to
            # slow the engine's next decode steps (tidal/trainer/threads.py says why).
            return on_own_thread(self._learn, sampled, trainer_wait=sampled.t_end - sampled.t_start)
        except Exception as e:
            stopped = self._stopped_by_disk(e)
            if stopped is None:
                raise
            raise stopped from e

    def _stopped_by_disk(self, e: BaseException) -> DiskError | None:
        """The DiskError a step's failure `e` stops the run with, when it is a disk error (the
        episodes of the steps in flight are then removed: nothing of them is half kept); None
        when it is not (or is one already: save() names its checkpoint itself)."""
        if disk_error(e) is not None and self.run_log.error is not None:
            e = self.run_log.error  # train.log met the full disk first (it does not raise): name it
        failure = None if isinstance(e, DiskError) else disk_failure(
            e, self.paths.root, self._learning or self.step + 1, self.paths.latest_checkpoint())
        if (failure is not None or isinstance(e, DiskError)) and self.episode_writer is not None:
            self.episode_writer.abandon()
        return failure

    def _produce(self, step: int) -> Sampled:
        """The rollout stage of a step: sample + reward (+ DAPO refill)."""
        with self._source_lock:  # the data position a checkpoint of step-1 must restore
            self._source_before[step] = self.source.state_dict()
        restored = self.pusher.restore(step)  # placement.engine_bootstrap=peer: dead replicas back from a peer
        t0 = time.perf_counter()
        with trace.span("rollout", cat="generate", step=step):
            episodes, train_eps, baselines, metrics = self._sample(step)
        return Sampled(step, episodes, train_eps, baselines, {**metrics, **restored}, t0, time.perf_counter())

    def _learn(self, s: Sampled, trainer_wait: float = 0.0) -> dict[str, float]:
        """The learning stages of a step, in order (the module docstring says what each does)."""
        self.trainer.step = self._learning = s.step  # named in the error of a role that fails, or of a write
        t0 = time.perf_counter()
        batch, metrics = self._prepare(s)
        metrics.update(self._update(s.step, batch))
        t_train = time.perf_counter() - t0
        metrics.update(self._publish(s.step))
        fired = self._observe(s, metrics, t0, t_train, trainer_wait)
        self.health.enforce(s.step, metrics, fired)
        if self.run_log.error is not None:  # train.log lost lines of this step (a full disk): not checkpointed
            raise self.run_log.error
        self._checkpoint(s.step, metrics)
        self._flush_trace()
        self._learning = None
        return metrics

    def _prepare(self, s: Sampled):
        """Failed episodes and the failure budget; the step's episode metrics; the batch with its
        advantages (None when nothing is trainable)."""
        metrics = s.metrics
        metrics.update(episode_metrics(s.episodes))
        self.health.before_update(s.step, s.episodes, metrics, self.metrics.log)
        metrics.update(staleness_metrics(s.train_eps, self.trainer.version, self.updates_per_step,
                                         self.cfg.rollout.max_staleness))
        if not s.train_eps:
            return None, metrics
        batch, prep = build_batch(s.train_eps, self.cfg.algorithm, self.trainer, kl_coef=self.kl_ctl.coef,
                                  estimator=self.estimator, baselines=s.baselines,
                                  image_token_id=self.vision.image_token_id if self.vision else None)
        metrics.update(prep)
        return batch, metrics

    def _update(self, step: int, batch) -> dict[str, float]:
        """train.epochs passes over train.mini_batches mini-batches, an optimizer step each: the
        trainer's `update`; the metrics averaged over the updates."""
        if batch is None:
            return {}
        tc = self.cfg.train
        with trace.span("train", cat="train", step=step, updates=tc.epochs * tc.mini_batches):
            per_update = self.trainer.update(batch, epochs=tc.epochs, mini_batches=tc.mini_batches,
                                             kl_coef=self.kl_ctl.coef)
        metrics = {k: sum(u[k] for u in per_update) / len(per_update) for k in per_update[0]} if per_update else {}
        metrics["kl_coef"] = self.kl_ctl.coef
        if "kl" in metrics:
            self.kl_ctl.update(metrics["kl"], len(batch))
        return metrics

    def _publish(self, step: int) -> dict[str, float]:
        """The new weights to every engine replica (weight sync); the step is done."""
        with trace.span("sync", cat="sync", step=step):
            out = self.pusher.push(step)
        self.step = step
        return out

    def _observe(self, s: Sampled, metrics: dict[str, float], t0: float, t_train: float,
                 trainer_wait: float) -> list[AlertEvent]:
        """Timings, held-out evaluation, monitors and alerts; then the step's metrics, sample
        table and episodes are written. Returns the alerts that fired."""
        cfg, step, episodes = self.cfg, s.step, s.episodes
        t1 = time.perf_counter()
        t_rollout = s.t_end - s.t_start
        dt = t1 - t0 + t_rollout if cfg.rollout.max_staleness == 0 else t1 - self._last_learn_end
        self._last_learn_end = t1
        tokens = sum(len(e.tokens) for e in episodes)
        metrics.update({"version": float(self.trainer.version), "time/step_s": dt, "time/rollout_s": t_rollout,
                        "time/train_s": t_train, "tokens_per_s": tokens / max(dt, 1e-9),
                        "time/samples_per_s": len(episodes) / max(dt, 1e-9),
                        "generated_tokens_per_s": sum(e.num_policy_tokens for e in episodes) / max(t_rollout, 1e-9),
                        "time/trainer_wait_s": trainer_wait, "time/engine_wait_s": s.admission_wait,
                        "time/elapsed_s": t1 - self._t_start,  # wall clock since the controller started
                        # at k=0 nothing generates while a step learns
                        "time/overlap": self._overlap.fraction(t0, t1) if cfg.rollout.max_staleness else 0.0})
        if cfg.run.eval_every and step % cfg.run.eval_every == 0:
            metrics.update(self._evaluate(step))
        fired = self.health.watch(step, episodes, metrics)  # they read the metrics: before they are written
        self.metrics.log(step, metrics)
        if cfg.run.log_samples and step % cfg.run.log_samples_every == 0 and episodes:
            self.metrics.table(step, *sample_table(step, episodes, cfg.run.log_samples, self.tokenizer))
        if self.episode_writer is not None:
            if self._writes_whole_steps:
                self.episode_writer.write(step, episodes)
            else:
                self.episode_writer.end_step(step)
        return fired

    def _checkpoint(self, step: int, metrics: dict[str, float]) -> None:
        """Save when due (run.save_every, the last step) or the best so far (eval.keep_best). A step
        over the failure budget, or with a non-finite gradient, is not checkpointed: the rotation
        would push out the checkpoints of good steps for one that learned (nearly) nothing."""
        cfg = self.cfg
        best = self.health.healthy and self._improves_best(metrics)
        if self.health.healthy and (best or (cfg.run.save_every and step % cfg.run.save_every == 0)
                                    or step == cfg.train.steps):
            with trace.span("save", cat="save", step=step):
                saved = self.save()
            if best:
                self._record_best(step, metrics[cfg.eval.keep_best], saved)

    # -- evaluation during training ---------------------------------------------------------
    def _evaluate(self, step: int) -> dict[str, float]:
        with trace.span("eval", cat="eval", step=step):
            out = evaluate_during_training(self.engine, self.eval_rollout, self.task.eval_rows, self.eval_sets,
                                           self.make_env, self.cfg.eval, step)
        if "eval/failed_frac" in out and "eval/accuracy" not in out and not getattr(self, "_said_no_accuracy", False):
            self._said_no_accuracy = True  # once: the reason does not change between evaluations
            log.warning("evaluation at step %d: no held-out episode was scored as right or wrong (%.0f%% failed; "
                        "no `correct` part, reward named `correct` or veRL `acc` among the others): eval/accuracy "
                        "is not reported (docs/rewards.md)", step, 100 * out["eval/failed_frac"])
        return out

    def _improves_best(self, metrics: dict[str, float]) -> bool:
        key = self.cfg.eval.keep_best
        if not key or key not in metrics or not math.isfinite(metrics[key]):
            return False
        best = read_best(self.paths.checkpoints)
        return best is None or (metrics[key] > best["value"] if self.cfg.eval.best_mode == "max"
                                else metrics[key] < best["value"])

    def _record_best(self, step: int, value: float, path: Path) -> None:
        write_best(self.paths.checkpoints, {"step": step, "metric": self.cfg.eval.keep_best,
                                            "mode": self.cfg.eval.best_mode, "value": value, "checkpoint": str(path)})
        prune(self.paths.checkpoints, self.cfg.run.keep_checkpoints, path, protect=path)  # the best before it may go
        log.info("eval.keep_best: step %d is the best so far (%s %.4f): %s", step, self.cfg.eval.keep_best, value, path)

    def _flush_trace(self) -> None:
        """This step's spans of every process into RUN/trace.jsonl (the actors' by a call each)."""
        if not self.cfg.run.trace:
            return
        events = trace.drain()
        remote = [h for h in [*self.trainer.ranks, *self.roles.env_handles] if h.remote]
        for handle in remote:
            try:
                events += handle.call("drain_trace", timeout_s=60.0)
            except Exception as e:  # noqa: BLE001 - a trace must not stop the run
                log.warning("run.trace: %s's spans could not be collected (%s: %s)", handle.role, type(e).__name__, e)
        trace.append(self.paths.root / "trace.jsonl", events)

    # -- sampling -----------------------------------------------------------------------------
    def _sample(self, step: int) -> tuple[list[Episode], list[Episode], dict[str, float], dict[str, float]]:
        """Roll out this step's prompts. Returns (every sampled episode, the episodes to train
        on, greedy baseline reward per group (an estimator that needs one), metrics).

        With DAPO's dynamic sampling, groups whose rewards are all equal are dropped and
        further prompts are sampled, up to `algorithm.max_sampling_rounds` rounds, until
        `rollout.prompts_per_step` informative groups are collected; extra groups are cut."""
        cfg, algo = self.cfg, self.cfg.algorithm
        greedy = needs(self.estimator, "greedy_baseline")
        want = cfg.rollout.prompts_per_step
        episodes: list[Episode] = []
        baselines: dict[str, float] = {}
        kept: list[str] = []  # group ids to train on, in sampling order
        rounds = 0
        # Episodes stream to the store as they finish, unless the step changes them afterwards:
        # dynamic sampling decides at the end which are trained, DAPO's overlong shaping changes
        # rewards, a greedy baseline drops groups without one (then the step is written whole).
        stream = self._stream if self.episode_writer is not None and not self._writes_whole_steps else None
        while True:
            rows = self.source.take(want)
            specs = group_specs(rows, self.make_env, cfg.rollout.samples_per_prompt, cfg.run.seed, step,
                                offset=rounds * want, greedy_baseline=greedy)
            new: list[Episode] = []  # this round's samples that were scored
            for spec, e in zip(specs, loop_scoped.run(self.rollout.run(specs, self.engine, step, on_episode=stream))):
                if spec.greedy:  # a baseline, not a sample: no training, no sample metrics
                    if e.status.trainable:
                        baselines[e.group_id] = e.reward
                    continue
                episodes.append(e)
                if e.status.trainable:
                    new.append(e)
            shape_rewards(new, algo, cfg.rollout.max_new_tokens)
            groups = list(dict.fromkeys(e.group_id for e in new))
            if greedy:
                groups = [g for g in groups if g in baselines]  # no baseline, no advantage
            if algo.dynamic_sampling:
                useful = informative(new)
                groups = [g for g in groups if g in useful]
            kept += groups
            rounds += 1
            if not algo.dynamic_sampling or len(kept) >= want or rounds >= algo.max_sampling_rounds:
                break
        kept_set = set(kept[:want] if algo.dynamic_sampling else kept)
        train_eps = [e for e in episodes if e.status.trainable and e.group_id in kept_set]
        trained = {id(e) for e in train_eps}
        for e in episodes:
            e.metrics["trained"] = float(id(e) in trained)
        metrics: dict[str, float] = {}
        if algo.dynamic_sampling:
            metrics.update({"sampling/rounds": float(rounds), "sampling/groups_kept": float(len(kept_set)),
                            "sampling/groups_generated": float(rounds * want)})
        if greedy and baselines:
            name = algo.advantage if algo.advantage in ESTIMATORS else "advantage"  # a path: not a metric name
            metrics[f"{name}/greedy_reward"] = sum(baselines.values()) / len(baselines)
        return episodes, train_eps, baselines, metrics

    @property
    def _writes_whole_steps(self) -> bool:
        algo = self.cfg.algorithm
        return algo.dynamic_sampling or algo.overlong_buffer > 0 or needs(self.estimator, "greedy_baseline")

    def _stream(self, e: Episode) -> None:
        # Streaming happens only without dynamic sampling or a greedy baseline (see
        # `_writes_whole_steps`): every trainable episode is trained, and no baseline is left out.
        e.metrics["trained"] = float(e.status.trainable)
        self.episode_writer.add(e)

    # -- the loops ----------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Train to train.steps. k = rollout.max_staleness = 0: `train_step` in a plain loop on
        this thread (step s starts after step s-1 is learned and published). k > 0: see
        `_train_ahead`. Either way the starting weights are evaluated first (eval.at_start)."""
        last: dict[str, float] = {}
        if self.cfg.eval.at_start and self.cfg.run.eval_every and self.step == 0:
            self.metrics.log(0, self._evaluate(0))  # the starting weights, as step 0
        # What exists now (the model, the roles, the libraries) lives for the whole run. Frozen,
        # it is left out of the collector's full passes, which otherwise walk it every few steps
        # (measured on the default job: a ~200 ms pause every 3-5 steps). Unfrozen at the end.
        gc.collect()
        gc.freeze()
        try:
            with Progress(total=self.cfg.train.steps, initial=self.step, enabled=self.cfg.run.progress) as bar:
                if self.cfg.rollout.max_staleness == 0:
                    while self.step < self.cfg.train.steps:
                        last = self.train_step()
                        bar.update(self.step, last)
                else:
                    last = self._train_ahead(bar)
        except BaseException as e:
            stopped = self._stopped_by_disk(e)
            # The whole account in train.log (unless it is what the disk refused); the caller
            # reports it on the console as before.
            self.run_log.file.exception("the run stopped after step %d: %s: %s", self.step, type(e).__name__,
                                        stopped or e)
            if stopped is not None:
                raise stopped from e
            raise
        finally:
            gc.unfreeze()
            self.metrics.close()
            self.run_log.close()
        return last

    def _train_ahead(self, bar: Progress) -> dict[str, float]:
        """k > 0: the asynchronous loop (tidal/runtime/ahead_loop.py) over this run's two parts."""
        self._last_learn_end = time.perf_counter()
        return train_ahead(self.step + 1, self.cfg.train.steps, self.cfg.rollout.max_staleness, self._produce,
                           self._learn, self._take_restored, self._ahead, self._overlap, bar)

    def close(self) -> None:
        """Stop the reward workers, the gateway, the engines (a vLLM server process ends with its
        engine) and the actors, and release the run directory. Also of a controller whose start
        failed half way. A disk error while closing (the trace's last write) is kept in
        `disk_error`, not raised: it must not replace the error the run may be stopping with
        (tidal train reports it)."""
        if self.cfg.run.trace and trace.enabled():
            try:
                self._flush_trace()
                n = trace.assemble(self.paths.root / "trace.jsonl", self.paths.root / "trace.json")
                log.info("run.trace: %d events in %s (open it in https://ui.perfetto.dev)", n,
                         self.paths.root / "trace.json")
            except Exception as e:  # noqa: BLE001 - closing goes on; a disk error is reported by the caller
                self.disk_error = disk_failure(e, self.paths.root, self.step, self.paths.latest_checkpoint())
                if self.disk_error is None:
                    log.warning("run.trace: the trace could not be assembled (%s: %s)", type(e).__name__, e)
            trace.disable()
        if self.parts is not None:
            self.parts.close()
        if self.run_log is not None:
            self.run_log.close()
        self.run_lock.release()

    # -- checkpoints -------------------------------------------------------------------------
    def save(self) -> Path:
        """Write to a temporary directory and rename: a checkpoint exists whole or not at all.
        A write that fails for the file system (a full disk, a quota, an I/O error) removes
        the partial directory and stops the run (RunFailed), naming the step, the path, the
        reason and the last good checkpoint, which stays as it was."""
        final = self.paths.checkpoint(self.step)
        tmp = final.with_name(final.name + ".tmp")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            self.trainer.save(tmp)
            ahead = self._steps_ahead()
            inflight.save(tmp, ahead)
            with self._source_lock:  # prompts taken for later steps (beyond those kept ahead) are not consumed yet
                data = self._source_before.get(self.step + 1 + len(ahead)) or self.source.state_dict()
            write_json(tmp / "controller.json", {"step": self.step, "data": data, "engine_version": self.engine.version,
                                                 "kl": self.kl_ctl.state_dict()})
            write_manifest(tmp)  # every file fsynced, sized and hashed before the rename
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            cause = file_system_error(e)
            if cause is None:
                raise
            last = self.paths.latest_checkpoint()
            raise DiskError(f"step {self.step}: the checkpoint could not be written to {final} ({cause}; "
                            f"{free_space(final)}); nothing of "
                            f"it was kept and the last good checkpoint is {last or 'none (no step was saved yet)'}. "
                            f"Free space, then continue with: tidal train --resume run.dir={self.paths.root}") from e
        with self._source_lock:
            self._source_before = {s: d for s, d in self._source_before.items() if s > self.step}
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        best = read_best(self.paths.checkpoints)
        prune(self.paths.checkpoints, self.cfg.run.keep_checkpoints, final,
              protect=Path(best["checkpoint"]) if best else None)
        return final

    def _load(self, ckpt: Path) -> None:
        self.trainer.load(ckpt)
        state = json.loads((ckpt / "controller.json").read_text())
        self.step = state["step"]
        self.source.load_state_dict(state["data"])
        if "kl" in state:
            self.kl_ctl.load_state_dict(state["kl"])
        self._restored = {r["step"]: _sampled_of(r) for r in inflight.load(ckpt)}
        self.pusher.push(self.step)

    def _steps_ahead(self) -> list[Sampled]:
        """The steps after this one that the asynchronous loop rolled out (or is rolling out)
        already, for the checkpoint: a resume trains on them as the run would have
        (tidal/runtime/inflight.py). Waits for those still in flight; none at k=0."""
        last = min(self.step + self.cfg.rollout.max_staleness, self.cfg.train.steps)
        return self._ahead.wait(self.step + 1, last) if last > self.step else []

    def _take_restored(self, step: int) -> Sampled | None:
        """A step the checkpoint kept ahead (None when it kept no such step): its episodes go to
        the store as a rolled-out step's do."""
        s = self._restored.pop(step, None)
        if s is None:
            return None
        s.t_start = s.t_end = time.perf_counter()
        if self.episode_writer is not None and not self._writes_whole_steps:
            for e in s.episodes:
                self.episode_writer.add(e)
        self._ahead.add(s)
        return s


def _sampled_of(record: dict) -> Sampled:
    eps = record["episodes"]
    return Sampled(record["step"], eps, [eps[i] for i in record["trained"]], record["baselines"], record["metrics"],
                   0.0, 0.0)

