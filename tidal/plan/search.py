"""The planner's search: every placement of the spec's search space that fits in memory, simulated for
`search.steps` steps, ranked by samples/s. The choice: an exhaustive grid (trainer/engine split x
engine TP x trainer TP x colocate x k x sync x worker counts), pruned by the memory model before any
simulation, since a simulated plan costs tens of milliseconds and the grids people ask for hold
hundreds of plans; a plan that cannot hold its weights is reported with the reason, never simulated.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tqdm import tqdm

from tidal.plan import cost
from tidal.plan.hardware import accelerator
from tidal.plan.loop import simulate
from tidal.plan.report import Summary, describe, summarize
from tidal.plan.spec import PlacementSpec, PlanSpec


@dataclass
class Plan:
    placement: PlacementSpec
    summary: Summary

    @property
    def name(self) -> str:
        return describe(self.placement)


def infeasible(spec: PlanSpec, p: PlacementSpec) -> str | None:
    """Why a placement cannot run (memory, divisibility), or None."""
    m, c, e = spec.model, spec.cluster, spec.efficiency
    hw = accelerator(c.gpu, c.accelerator)
    g = p.engine_gpus_per_replica
    if g > c.gpus_per_node:
        return f"an engine replica of {g} GPUs spans nodes"
    if p.train_tp * p.train_cp > c.gpus_per_node:
        return "trainer TP x CP spans nodes"
    if p.trainer_gpus % (p.train_tp * p.train_cp):
        return f"{p.trainer_gpus} trainer GPUs are not a multiple of TP x CP = {p.train_tp * p.train_cp}"
    if cost.engine_kv_capacity_tokens(m, hw, e, g) <= spec.workload.prompt_tokens + spec.workload.lengths.mean:
        return f"the weights leave no KV cache on a replica of {g} GPUs"
    need = cost.trainer_memory_per_gpu(m, e, p.trainer_gpus, p.train_tp)
    if need > hw.hbm_bytes:
        return f"the trainer needs {need / 1e9:.0f} GB per GPU of {hw.hbm_bytes / 1e9:.0f}"
    if cost.replicas(p, c) < 1:
        return "no engine replica"
    return None


def candidates(spec: PlanSpec) -> list[PlacementSpec]:
    s, n = spec.search, spec.cluster.gpus
    base = spec.placement.model_dump()
    out, seen = [], set()
    for colocate, k, etp, ttp, frac, sync, rw, ew in itertools.product(
            s.colocate, s.max_staleness, s.engine_tp, s.train_tp, s.trainer_fractions, s.sync, s.reward_workers,
            s.env_workers):
        if colocate:
            train, eng, sync = n, n, "inprocess"
        else:
            unit = max(ttp, etp * base["engine_ep"])
            train = max(ttp, round(n * frac / unit) * unit)
            eng = n - train
            if eng < etp * base["engine_ep"]:
                continue
        p = PlacementSpec(**{**base, "trainer_gpus": train, "engine_gpus": eng, "engine_tp": etp, "train_tp": ttp,
                             "colocate": colocate, "max_staleness": k, "sync": sync, "reward_workers": rw,
                             "env_workers": ew})
        key = tuple(p.model_dump().values())
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def search(spec: PlanSpec, progress: bool = True) -> tuple[list[Plan], list[tuple[PlacementSpec, str]]]:
    """(simulated plans, best first; rejected placements with the reason)."""
    plans, rejected = [], []
    cands = candidates(spec)
    for p in tqdm(cands, desc="plans", unit="plan", disable=not progress):
        why = infeasible(spec, p)
        if why:
            rejected.append((p, why))
            continue
        trial = spec.model_copy(update={"placement": p})
        plans.append(Plan(p, summarize(simulate(trial, spec.search.steps))))
    # ties (within 0.1%: k beyond what the stages need changes nothing) go to the plan with less
    # staleness, then fewer GPUs per engine replica
    plans.sort(key=lambda x: (-round(x.summary.samples_per_s, 3 - len(str(int(x.summary.samples_per_s)))),
                              x.summary.staleness_mean, x.placement.engine_tp))
    return plans, rejected


def distinct(plans: list[Plan], rel: float = 1e-3) -> list[tuple[Plan, list[Plan]]]:
    """Plans with their equals: a plan that differs from an earlier one only in k and predicts the
    same samples/s (within `rel`) is listed under it, not as a plan of its own."""
    out: list[tuple[Plan, list[Plan]]] = []
    for x in plans:
        for head, same in out:
            hp, xp = head.placement.model_dump(), x.placement.model_dump()
            hp.pop("max_staleness"), xp.pop("max_staleness")
            if hp == xp and abs(x.summary.samples_per_s / head.summary.samples_per_s - 1) <= rel:
                same.append(x)
                break
        else:
            out.append((x, []))
    return out


def explain(a: Plan, b: Plan) -> str:
    """Why plan a beats plan b, in the terms of the simulation: where each one's step goes."""
    sa, sb = a.summary, b.summary
    lines = [f"A: {a.name}", f"B: {b.name}",
             (f"A makes {sa.samples_per_s:.2f} samples/s, B {sb.samples_per_s:.2f} "
              f"({sa.samples_per_s / max(sb.samples_per_s, 1e-12):.2f}x): a step every {sa.step_s:.1f} s against "
              f"{sb.step_s:.1f} s.")]
    for name, s in (("A", sa), ("B", sb)):
        lines.append(f"{name}: rollout {s.rollout_s:.1f} s, train {s.train_s:.1f} s, sync {s.sync_s:.2f} s per step; "
                     f"the trainer waits {s.trainer_wait_s:.1f} s, the rollout waits {s.engine_wait_s:.1f} s for "
                     f"admission; bottleneck: {s.bottleneck}; idle engines {s.idle['engines']:.0%}, trainer "
                     f"{s.idle['trainer']:.0%}.")
    pa, pb = a.placement, b.placement
    if pa.colocate != pb.colocate:
        lines.append("Colocated roles take turns on every GPU (no overlap, a sleep/wake switch per step); apart, "
                     "generation and training overlap when k > 0 but each has fewer GPUs.")
    if pa.max_staleness != pb.max_staleness:
        lines.append(f"k={pa.max_staleness} against k={pb.max_staleness}: with k > 0 the rollout of step s "
                     f"overlaps the learning of step s-1 (the step costs about the longer of the two, not the sum).")
    if (pa.trainer_gpus, pa.engine_gpus) != (pb.trainer_gpus, pb.engine_gpus) and not (pa.colocate or pb.colocate):
        lines.append(f"The split {pa.trainer_gpus}:{pa.engine_gpus} against {pb.trainer_gpus}:{pb.engine_gpus} "
                     f"(train:generate) balances the two stages differently.")
    if pa.sync != pb.sync:
        lines.append(f"Sync {pa.sync} ({sa.sync_s:.2f} s) against {pb.sync} ({sb.sync_s:.2f} s).")
    return "\n".join(lines)
