"""tidal's training loop as a discrete-event simulation on SimPy: a rollout process and a learning process
joined by a bounded store, with tidal's admission rule (step s starts once the engines hold version
s-1-k, `tidal/runtime/controller.py:Controller.train`), weight syncs that pause the engines mid-rollout
(partial rollouts: the tokens after the pause carry the new version), colocated roles that take turns on
the GPUs (a priority resource: the learner first, with a sleep/wake switch each step), DAPO refills, and
node failures that restart every role from the last checkpoint (lost steps are redone).

The choice: SimPy schedules the few events of each step (admission, rollout end, train, sync, failures);
a rollout's many decode iterations are computed at once by `rollout_model` and enter the simulation as
one timeout that a sync may interrupt, so 1,000 steps of a 4,096-GPU plan take seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import simpy

from tidal.plan import cost
from tidal.plan.hardware import accelerator
from tidal.plan.rollout_model import simulate_rollout, stream_rollout_s
from tidal.plan.spec import PlanSpec
from tidal.plan.sync_model import sync_cost
from tidal.plan.workload import LengthSampler, step_work


@dataclass
class StepRecord:
    step: int
    rollout_start: float = 0.0
    rollout_end: float = 0.0
    admission_wait: float = 0.0
    gen_s: float = 0.0  # generation (all rounds), pauses excluded
    reward_tail_s: float = 0.0  # after the last token until the last reward
    pause_s: float = 0.0  # weight syncs that paused this rollout
    rounds: int = 1
    episodes: int = 0  # sampled
    trained: int = 0  # episodes trained on
    gen_tokens: int = 0
    train_tokens: int = 0
    train_start: float = 0.0
    train_end: float = 0.0
    sync_end: float = 0.0
    learn_end: float = 0.0  # after the checkpoint, if any
    trainer_wait: float = 0.0
    version_start: int = 0
    staleness_max: int = 0
    staleness_mean: float = 0.0
    replica_busy_s: float = 0.0  # summed over replicas
    env_busy_s: float = 0.0
    reward_busy_s: float = 0.0
    episode_finish: np.ndarray | None = None  # for the trace: the first round's finish times


@dataclass
class SimResult:
    spec: PlanSpec
    records: list[StepRecord]
    wall_s: float
    failures: int = 0
    lost_s: float = 0.0
    replicas: int = 0
    costs: dict = field(default_factory=dict)


class Simulator:
    def __init__(self, spec: PlanSpec, steps: int | None = None):
        self.spec = spec
        self.steps = steps or spec.sim.steps
        m, c, p, e, w = spec.model, spec.cluster, spec.placement, spec.efficiency, spec.workload
        self.hw = accelerator(c.gpu, c.accelerator)
        self.n_train = p.trainer_gpus
        self.R = cost.replicas(p, c)
        if self.R < 1:
            raise ValueError(f"placement: {p.engine_gpus} engine GPUs hold no replica of {p.engine_gpus_per_replica}")
        g = p.engine_gpus_per_replica
        kv_cap = cost.engine_kv_capacity_tokens(m, self.hw, e, g)
        per_seq = w.prompt_tokens + min(w.lengths.mean, w.lengths.max) * w.turns + w.obs_tokens * (w.turns - 1)
        self.max_batch = int(max(1, min(e.max_batch, kv_cap / per_seq))) if kv_cap > 0 else 0
        self.sync = sync_cost(m, self.hw, e, c, p, "inprocess" if p.colocate else None)
        self.switch_s = cost.switch_s(m, self.hw, e, p, self.n_train) if p.colocate else 0.0
        self.ckpt_s = spec.failures.checkpoint_s if spec.failures.checkpoint_s is not None else cost.checkpoint_s(m, c)
        self.sampler = LengthSampler(w.lengths, spec.sim.seed)
        self.rng = np.random.default_rng(spec.sim.seed + 1)
        self.env_slots = max(1, p.env_workers) * w.env_concurrency
        self.reward_workers = max(1, p.reward_workers)

    # -- one step's pieces ----------------------------------------------------------------------
    def _rollout(self, step: int) -> tuple[StepRecord, object]:
        """Generate (and score) one step's episodes: DAPO rounds until enough informative groups."""
        spec, w, p = self.spec, self.spec.workload, self.spec.placement
        rec = StepRecord(step)
        want, kept, gen, tail, tokens, train_tokens, env_busy = w.prompts_per_step, 0, 0.0, 0.0, 0, 0, 0.0
        curves = []
        while True:
            work = step_work(w, self.sampler, want, self.rng)
            if p.rollout_mode == "stream":
                d, busy = stream_rollout_s(work, self.R, spec.model, self.hw, spec.efficiency, p.engine_tp,
                                           p.engine_ep, self.max_batch, p.max_staleness + 1)
                finish = np.full(work.episodes, d)
                res = None
            else:
                res = simulate_rollout(work, self.R, spec.model, self.hw, spec.efficiency, p.engine_tp, p.engine_ep,
                                       self.max_batch, self.env_slots, w.prefix_sharing, spec.sim.chunks)
                d, busy, finish = res.duration_s, res.replica_busy_s, res.finish_s
            if rec.episode_finish is None:
                rec.episode_finish = finish
            d += spec.efficiency.rollout_overhead_s
            reward_end = self._reward_end(finish) + spec.efficiency.rollout_overhead_s
            curves.append((gen, res, d))
            gen += d
            tail += reward_end - d
            rec.replica_busy_s += float(busy.sum())
            n_tok = int(work.lengths.sum())
            tokens += n_tok
            env_busy += float(work.env_latency[:, :-1].sum()) if w.turns > 1 else 0.0
            groups = want if w.uninformative_frac == 0 else int(self.rng.binomial(want, 1 - w.uninformative_frac))
            use = min(groups, w.prompts_per_step - kept)
            per_ep = (w.prompt_tokens + n_tok / work.episodes + w.obs_tokens * (w.turns - 1))
            train_tokens += int(use * w.samples_per_prompt * per_ep)
            kept += use
            rec.episodes += work.episodes
            if w.uninformative_frac == 0 or kept >= w.prompts_per_step or rec.rounds >= w.max_sampling_rounds:
                break
            rec.rounds += 1
        rec.gen_s, rec.reward_tail_s, rec.gen_tokens, rec.train_tokens = gen, tail, tokens, train_tokens
        rec.trained = kept * w.samples_per_prompt
        rec.env_busy_s = env_busy
        rec.reward_busy_s = rec.episodes * w.reward_s
        return rec, curves

    def _reward_end(self, finish: np.ndarray) -> float:
        """When the last reward is scored: episodes queue for W workers as they finish (a fluid queue)."""
        r = self.spec.workload.reward_s
        if r == 0 or len(finish) == 0:
            return float(finish.max()) if len(finish) else 0.0
        a = np.sort(finish)
        left = len(a) - np.arange(len(a))
        return float(np.max(a + np.ceil(left / self.reward_workers) * r))

    def _tokens_done_frac(self, curves, work_done: float) -> float:
        """Share of the step's generated tokens produced by `work_done` seconds of its rollout."""
        total = done = 0.0
        for start, res, d in curves:
            n = res.curve_tokens[-1] if res is not None else d
            total += n
            if res is None:
                done += min(max(work_done - start, 0.0), d)
            else:
                done += res.tokens_before(min(max(work_done - start, 0.0), d))
        return done / total if total else 1.0

    # -- the processes ----------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Simulate `self.steps` steps (restarts after failures included); the steps' records."""
        self.env = simpy.Environment()
        self.records: dict[int, StepRecord] = {}
        self.failures, self.lost_s = 0, 0.0
        # what the processes share: the version the engines hold (and the event of its next
        # change), the rollout in flight, the last checkpoint, the GPUs when colocated, and how
        # many rolled-out steps wait to be learned
        self.state = {"published": 0, "event": self.env.event(), "rollout": None, "ckpt_step": 0, "ckpt_t": 0.0,
                      "prod": None, "gpus": None, "unlearned": 0}
        done = self.env.process(self._supervisor())
        self.env.run(until=done)  # not past it: a failure drawn for after the last step must not move the clock
        recs = [self.records[s] for s in sorted(self.records)]
        return SimResult(self.spec, recs, self.env.now, self.failures, self.lost_s, self.R,
                         {"sync_s": self.sync.total_s, "switch_s": self.switch_s, "checkpoint_s": self.ckpt_s,
                          "max_batch": self.max_batch})

    def _publish(self, v: int) -> None:
        """The engines now hold version `v`: wake whoever waits for it."""
        self.state["published"] = v
        ev, self.state["event"] = self.state["event"], self.env.event()
        ev.succeed()

    def _producer(self, start: int, store: simpy.Store):
        """Roll out steps from `start` as the admission rule allows (version >= s-1-k), paused by
        each weight sync; each step's staleness recorded."""
        k = self.spec.placement.max_staleness
        for s in range(start, self.steps + 1):
            t0 = self.env.now
            while self.state["published"] < s - 1 - k:
                yield self.state["event"]
            gpus = self.state["gpus"]
            req = None
            if gpus is not None:
                # colocated: a handed-over step is trained before the next rollout takes the GPUs
                while self.state["unlearned"]:
                    yield self.state["event"]
                req = gpus.request(priority=1)
                yield req
            rec, curves = self._rollout(s)
            rec.admission_wait, rec.rollout_start = self.env.now - t0, self.env.now
            rec.version_start = self.state["published"]
            versions = []  # (share of tokens before the update, new version)
            remaining = total = rec.gen_s + rec.reward_tail_s
            self.state["rollout"] = self.state["prod"]
            while remaining > 1e-12:
                t_start = self.env.now
                try:
                    yield self.env.timeout(remaining)
                    remaining = 0.0
                except simpy.Interrupt as i:
                    if i.cause == "fail":
                        raise
                    remaining -= self.env.now - t_start
                    version, pause = i.cause
                    versions.append((self._tokens_done_frac(curves, total - remaining), version))
                    rec.pause_s += pause
                    remaining += pause  # the engines stop for the update, then go on
            self.state["rollout"] = None
            if req is not None:
                gpus.release(req)
            rec.rollout_end = self.env.now
            lag0 = (s - 1) - rec.version_start
            shares, prev = [], 0.0
            lags = [lag0]
            for frac, v in versions:
                shares.append(frac - prev)
                prev = frac
                lags.append((s - 1) - v)
            shares.append(1.0 - prev)
            if lag0 > k:  # the admission rule above makes this impossible; a broken model must not report
                raise RuntimeError(f"step {s} started at version {rec.version_start}: staleness {lag0} > k={k}")
            rec.staleness_max = lag0
            rec.staleness_mean = float(sum(a * b for a, b in zip(shares, lags)))
            self.records[s] = rec
            self.state["unlearned"] += 1
            yield store.put(rec)

    def _learner(self, start: int, store: simpy.Store):
        """Train each rolled-out step, sync the weights (interrupting a rollout in flight: a
        partial rollout), publish the version, checkpoint when due."""
        spec, p = self.spec, self.spec.placement
        for s in range(start, self.steps + 1):
            t0 = self.env.now
            rec = yield store.get()
            rec.trainer_wait = self.env.now - t0
            gpus = self.state["gpus"]
            req = gpus.request(priority=0) if gpus else None
            if req is not None:
                yield req
            rec.train_start = self.env.now
            mean_ctx = rec.train_tokens / max(rec.trained, 1)
            tc = cost.train_step_cost(rec.train_tokens, mean_ctx, spec.model, self.hw, spec.efficiency,
                                      spec.cluster, self.n_train, p.train_tp, p.train_cp, p.train_ep)
            yield self.env.timeout(tc.total_s + self.switch_s)
            rec.train_end = self.env.now
            rollout = self.state["rollout"]
            if rollout is not None and rollout.is_alive and not p.colocate:
                rollout.interrupt((s, self.sync.total_s))  # a partial rollout: engines take version s
            yield self.env.timeout(self.sync.total_s)
            rec.sync_end = self.env.now
            if req is not None:
                gpus.release(req)
            self.state["unlearned"] -= 1
            self._publish(s)
            if s % spec.failures.save_every == 0 or s == self.steps:
                yield self.env.timeout(self.ckpt_s)
                self.state["ckpt_step"], self.state["ckpt_t"] = s, self.env.now
            rec.learn_end = self.env.now

    def _supervisor(self):
        """Start the rollout and learning processes from the last checkpoint; on a node failure
        (exponential, `failures.node_mtbf_h` per node) end them, count the lost time, restart."""
        spec, p, k = self.spec, self.spec.placement, self.spec.placement.max_staleness
        start, mtbf = 1, spec.failures.node_mtbf_h
        nodes = max(1, math.ceil(spec.cluster.gpus / spec.cluster.gpus_per_node))
        while True:
            store = simpy.Store(self.env, capacity=k + 1)
            self.state["published"], self.state["unlearned"] = start - 1, 0
            # a fresh GPU resource per (re)start: a killed process's request must not hold it
            self.state["gpus"] = simpy.PriorityResource(self.env, capacity=1) if p.colocate else None
            prod = self.state["prod"] = self.env.process(_quiet(self._producer)(start, store))
            learn = self.env.process(_quiet(self._learner)(start, store))
            fail = self.env.timeout(self.rng.exponential(mtbf * 3600 / nodes)) if mtbf else self.env.event()
            result = yield learn | fail
            if learn in result:
                if prod.is_alive:
                    prod.interrupt("fail")
                return
            self.failures += 1
            if self.failures > spec.failures.max_failures:
                raise RuntimeError(
                    f"failures: {self.failures} failures and the run is at step {self.state['ckpt_step']} of "
                    f"{self.steps}: with node_mtbf_h={mtbf} on {nodes} nodes a failure comes every "
                    f"{mtbf * 3600 / nodes:.0f} s on average, too often for save_every={spec.failures.save_every}")
            for proc in (prod, learn):
                if proc.is_alive:
                    proc.interrupt("fail")
            self.lost_s += self.env.now - self.state["ckpt_t"] + spec.failures.restart_s
            start = self.state["ckpt_step"] + 1
            for s in [s for s in self.records if s >= start]:
                del self.records[s]
            self.state["rollout"] = None
            yield self.env.timeout(spec.failures.restart_s)


def _quiet(gen_fn):
    """Wrap a SimPy process function so that an interrupt with cause 'fail' ends it without an error."""
    def wrapped(*args):
        try:
            yield from gen_fn(*args)
        except simpy.Interrupt as i:
            if i.cause != "fail":
                raise
    return wrapped


def simulate(spec: PlanSpec, steps: int | None = None) -> SimResult:
    return Simulator(spec, steps).run()
