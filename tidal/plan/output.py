"""What `tidal plan` writes: the chosen plan as a tidal config (`plan.yaml`, loadable by `tidal train`),
a plot of throughput against k and against the trainer/engine split (`plan.png`), and every simulated
plan as JSON. The choice: the config carries only settings tidal has (the trainer's mesh as
train.parallel, the engines' tensor parallelism, every sync transport); what the plan assumes beyond them
(engine expert parallelism, a trainer mesh tidal does not build, the stream what-if) is written as the
config's header comment, never as a key tidal would refuse.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tidal.plan.search import Plan
from tidal.plan.spec import PlacementSpec, PlanSpec

TIDAL_TRANSPORTS = {"broadcast": "broadcast", "slices": "slices", "shard": "shard", "delta": "shard",
                    "disk": "disk", "inprocess": "inprocess"}


def tidal_config(spec: PlanSpec, p: PlacementSpec) -> tuple[dict, list[str]]:
    """(a tidal config dict for the placement, notes on what it cannot express)."""
    w = spec.workload
    notes = []
    replicas = (p.trainer_gpus if p.colocate else p.engine_gpus) // p.engine_gpus_per_replica
    ranks = p.trainer_gpus  # every trainer GPU is a rank of tidal's mesh (train.parallel, docs/parallel.md)
    if p.colocate and replicas != ranks:
        notes.append(f"colocated engines of TP{p.engine_tp}: tidal colocates one replica per trainer rank, so the "
                     f"config runs {ranks} replicas")
        replicas = ranks
    if p.engine_ep > 1:
        notes.append(f"engine replicas of TP{p.engine_tp} x EP{p.engine_ep}: set the engine's expert parallelism "
                     f"(vLLM enable_expert_parallel); each replica reserves {p.engine_gpus_per_replica} GPUs")
    parallel = {"tp": p.train_tp, "cp": p.train_cp}
    if p.train_ep > 1 and p.train_tp * p.train_cp > 1:
        notes.append(f"trainer EP{p.train_ep} with TP{p.train_tp} CP{p.train_cp}: tidal's expert parallelism does not "
                     f"combine with tp or cp (docs/parallel.md); the config keeps tp and cp")
    elif p.train_ep > 1:
        parallel["ep"] = p.train_ep
    transport = TIDAL_TRANSPORTS[p.sync]
    if transport == "broadcast" and p.engine_tp > 1:
        transport = "slices"  # tidal's auto for tensor-parallel engines; the plan's broadcast sends every rank all
        notes.append("sync `broadcast` to tensor-parallel engines: the config uses tidal's `slices` (each engine "
                     "rank receives its slices only), which the plan did not time")
    if p.rollout_mode == "stream":
        notes.append("rollout_mode=stream (engines never wait for a step's tail) is a what-if tidal does not run")
    cfg = {
        "rollout": {"prompts_per_step": w.prompts_per_step, "samples_per_prompt": w.samples_per_prompt,
                    "max_new_tokens": w.lengths.max, "max_turns": w.turns, "max_staleness": p.max_staleness},
        "engine": {"kind": "vllm", "replicas": replicas, "tensor_parallel": p.engine_tp},
        "train": {"parallel": parallel},
        "placement": {"mode": "ray", "trainer_ranks": ranks, "colocate": p.colocate,
                      "trainer": {"num_gpus": 1.0}, "engine": {"num_gpus": float(p.engine_gpus_per_replica)},
                      "reward_workers": p.reward_workers, "env_workers": p.env_workers,
                      "weight_sync": "inprocess" if p.colocate else transport},
    }
    if p.sync == "delta" and not p.colocate:
        cfg["placement"]["weight_sync_delta"] = {"enabled": True}
    return cfg, notes


def write_config(spec: PlanSpec, plan: Plan, path: Path) -> Path:
    cfg, notes = tidal_config(spec, plan.placement)
    s = plan.summary
    head = [f"# tidal plan: {plan.name}",
            (f"# predicted: {s.samples_per_s:.2f} samples/s, {s.tokens_per_s_per_gpu:.0f} tokens/s/GPU, "
             f"a step every {s.step_s:.1f} s, staleness mean {s.staleness_mean:.2f} (max {s.staleness_max}), "
             f"bottleneck: {s.bottleneck}")]
    head += [f"# note: {n}" for n in notes]
    path.write_text("\n".join(head) + "\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


def write_plot(plans: list[Plan], path: Path) -> Path | None:
    """Best samples/s per k, and per trainer share of the GPUs (disaggregated plans); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for colocate, style in ((False, "o-"), (True, "s--")):
        by_k: dict[int, float] = {}
        for x in plans:
            if x.placement.colocate == colocate:
                k = x.placement.max_staleness
                by_k[k] = max(by_k.get(k, 0.0), x.summary.samples_per_s)
        if by_k:
            ks = sorted(by_k)
            ax1.plot(ks, [by_k[k] for k in ks], style, label="colocated" if colocate else "disaggregated")
    ax1.set(xlabel="max_staleness k", ylabel="samples/s (best plan)", title="throughput against k")
    ax1.legend()
    for k in sorted({x.placement.max_staleness for x in plans}):
        by_split: dict[float, float] = {}
        for x in plans:
            p = x.placement
            if not p.colocate and p.max_staleness == k:
                f = p.trainer_gpus / (p.trainer_gpus + p.engine_gpus)
                by_split[f] = max(by_split.get(f, 0.0), x.summary.samples_per_s)
        if by_split:
            fs = sorted(by_split)
            ax2.plot(fs, [by_split[f] for f in fs], "o-", label=f"k={k}")
    ax2.set(xlabel="share of GPUs that train", ylabel="samples/s (best plan)", title="throughput against the split")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plans(plans: list[Plan], rejected, path: Path) -> Path:
    rows = [{"placement": x.placement.model_dump(), "summary": x.summary.as_dict()} for x in plans]
    rows += [{"placement": p.model_dump(), "rejected": why} for p, why in rejected]
    path.write_text(json.dumps(rows, indent=1))
    return path
