"""What a simulated run comes to: samples/s, tokens/s per GPU, step time, staleness, the idle share of
each role and the bottleneck, over the steps after the warm-up (the same window `benchmarks/async.py`
measures: from the end of learning step `warmup` to the end of the last step). The choice of
bottleneck: the role the other waits for (the trainer waits for rollouts: generation, or the
environment or rewards when their share of the rollout is larger; the rollout waits for admission: the
trainer, or the weight sync when it takes longer than training).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tidal.plan.loop import SimResult


@dataclass
class Summary:
    samples_per_s: float
    tokens_per_s_per_gpu: float  # generated tokens per second per GPU of the cluster's plan
    step_s: float
    rollout_s: float
    train_s: float
    sync_s: float
    staleness_mean: float
    staleness_max: int
    idle: dict[str, float]
    bottleneck: str
    trainer_wait_s: float
    engine_wait_s: float
    failures: int
    lost_s: float
    gpus: int

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(r: SimResult) -> Summary:
    spec, p = r.spec, r.spec.placement
    recs = r.records
    w = min(spec.sim.warmup_steps, max(0, len(recs) - 2))
    window = recs[w + 1:] if len(recs) > w + 1 else recs
    t0 = recs[w].learn_end if len(recs) > w + 1 else 0.0
    t1 = recs[-1].learn_end
    # failures are paid in wall clock: lost time spreads over the window in proportion
    wall = max(t1 - t0, 1e-12)
    n = len(window)
    mean = lambda f: sum(f(x) for x in window) / max(n, 1)
    gpus = p.trainer_gpus if p.colocate else p.trainer_gpus + p.engine_gpus
    engine_gpus = p.trainer_gpus if p.colocate else p.engine_gpus
    engine_busy = sum(x.replica_busy_s for x in window) / max(r.replicas * wall, 1e-12)
    train_busy = sum(x.sync_end - x.train_start for x in window) / wall
    slots = max(1, p.env_workers) * spec.workload.env_concurrency
    env_busy = sum(x.env_busy_s for x in window) / (slots * wall)
    reward_busy = sum(x.reward_busy_s for x in window) / (max(1, p.reward_workers) * wall)
    trainer_wait, engine_wait = mean(lambda x: x.trainer_wait), mean(lambda x: x.admission_wait)
    train_s, sync_s = mean(lambda x: x.train_end - x.train_start), mean(lambda x: x.sync_end - x.train_end)
    rollout_s = mean(lambda x: x.rollout_end - x.rollout_start)
    if p.colocate:
        bottleneck = "generation" if rollout_s >= train_s else "training"
    elif trainer_wait >= engine_wait:
        env_share = mean(lambda x: x.env_busy_s / max(x.episodes, 1))
        reward_tail = mean(lambda x: x.reward_tail_s)
        bottleneck = max([("generation", rollout_s - reward_tail - env_share), ("environment", env_share),
                          ("rewards", reward_tail)], key=lambda kv: kv[1])[0]
    else:
        bottleneck = "weight sync" if sync_s > train_s else "training"
    return Summary(
        samples_per_s=sum(x.trained for x in window) / wall,
        tokens_per_s_per_gpu=sum(x.gen_tokens for x in window) / wall / gpus,
        step_s=wall / max(n, 1), rollout_s=rollout_s, train_s=train_s, sync_s=sync_s,
        staleness_mean=mean(lambda x: x.staleness_mean), staleness_max=max((x.staleness_max for x in recs), default=0),
        idle={"engines": float(max(0.0, 1 - engine_busy)), "trainer": float(max(0.0, 1 - train_busy)),
              "env": float(max(0.0, 1 - env_busy)), "reward": float(max(0.0, 1 - reward_busy))},
        bottleneck=bottleneck, trainer_wait_s=trainer_wait, engine_wait_s=engine_wait,
        failures=r.failures, lost_s=r.lost_s, gpus=gpus if engine_gpus else p.trainer_gpus)


def describe(p) -> str:
    """One line naming a placement."""
    if p.colocate:
        roles = f"colocated on {p.trainer_gpus} GPUs, engines TP{p.engine_tp}"
    else:
        roles = f"train {p.trainer_gpus} GPUs (TP{p.train_tp}) + engines {p.engine_gpus} GPUs (TP{p.engine_tp})"
    extra = f", EP{p.engine_ep}" if p.engine_ep > 1 else ""
    return f"{roles}{extra}, k={p.max_staleness}, sync {p.sync}, env {p.env_workers}, reward {p.reward_workers}"
