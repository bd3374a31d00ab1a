"""One step's rollout on the engine replicas: continuous batching with a step time per decode iteration,
prefill, prefix sharing within a group, multi-turn episodes that leave the batch for the environment's
latency and come back, and a KV-cache bound on the batch. Vectorized with numpy over every episode and
replica of the step, advancing in chunks of decode iterations (at most `chunks` per turn), so that a
step of thousands of episodes costs tens of array operations, not an event per token.

The choices: an episode stays on one replica (tidal's router is sticky per episode; a group shares a
replica when there are more groups than replicas, so its prompt is prefilled once); a replica whose
sequences exceed its batch bound serves them by turns (processor sharing: the same tokens per second as
a queue, finishing order aside); the environment's steps of one step share `env_slots` (every episode is
assumed to reach it at once: pessimistic where turns do not align).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tidal.plan.cost import decode_iter_s, prefill_s
from tidal.plan.hardware import Accelerator
from tidal.plan.spec import Efficiency, ModelSpec
from tidal.plan.workload import StepWork


@dataclass
class RolloutResult:
    duration_s: float  # until the last episode's last token (rewards not included)
    finish_s: np.ndarray  # [E] when each episode's generation ended, from the rollout's start
    replica_busy_s: np.ndarray  # [R] seconds each replica spent prefilling or decoding
    tokens: int  # generated tokens
    curve_t: np.ndarray  # a monotone curve of (time, generated tokens so far) for version attribution
    curve_tokens: np.ndarray

    def tokens_before(self, t: float) -> float:
        """Generated tokens by time t from the rollout's start (linear between curve points)."""
        return float(np.interp(t, self.curve_t, self.curve_tokens))


def assign_replicas(group: np.ndarray, n_rep: int) -> np.ndarray:
    """Replica of each episode: whole groups, spread evenly, when there are at least as many groups as
    replicas; otherwise the episodes round-robin (a group spans replicas)."""
    groups = int(group.max()) + 1
    if groups >= n_rep:
        return (group * n_rep) // groups
    return np.arange(len(group)) % n_rep


def simulate_rollout(work: StepWork, n_rep: int, m: ModelSpec, hw: Accelerator, eff: Efficiency, tp: int, ep: int,
                     max_batch: int, env_slots: int, prefix_sharing: bool, chunks: int = 64,
                     exact_single_turn: bool = True) -> RolloutResult:
    E, T = work.lengths.shape
    R, g = n_rep, tp * ep
    rep = assign_replicas(work.group, R)
    # prompts: prefilled at the start, once per (group, replica) with prefix sharing
    if prefix_sharing:
        pairs = np.unique(work.group.astype(np.int64) * R + rep)
        prompts = np.bincount(pairs % R, minlength=R) * work.prompt_tokens
    else:
        prompts = np.bincount(rep, minlength=R) * work.prompt_tokens
    clock = prefill_s(prompts, m, hw, eff, g)
    if exact_single_turn and T == 1 and np.bincount(rep, minlength=R).max() <= max_batch:
        return _single_turn(work.lengths[:, 0], rep, R, clock, work.prompt_tokens, m, hw, eff, tp, ep)
    busy = clock.copy()
    env_factor = max(1.0, E / env_slots) if work.env_latency.any() else 1.0
    c = max(1, -(-int(work.lengths.max()) // chunks))
    turn = np.zeros(E, np.int64)
    rem = work.lengths[:, 0].astype(float)
    ready = np.zeros(E)
    done = np.zeros(E, bool)
    ctx = np.full(E, float(work.prompt_tokens))
    finish = np.zeros(E)
    curve_t, curve_n, generated = [0.0], [0.0], 0.0
    while not done.all():
        active = ~done & (ready <= clock[rep] + 1e-12)
        ra = rep[active]
        cnt = np.bincount(ra, minlength=R).astype(float)
        has = cnt > 0
        if has.any():
            kvs = np.bincount(ra, weights=ctx[active], minlength=R)
            maxrem = np.zeros(R)
            np.maximum.at(maxrem, ra, rem[active])
            share = np.where(has, np.minimum(1.0, max_batch / np.maximum(cnt, 1)), 0.0)
            b = np.minimum(cnt, max_batch)
            n = np.where(has, np.minimum(c, np.ceil(maxrem / np.maximum(share, 1e-12) - 1e-9)), 0.0)
            kv = b * (kvs / np.maximum(cnt, 1) + n / 2)  # the batch's cache, mid-chunk
            dt = np.where(has, n * decode_iter_s(b, kv, m, hw, eff, tp, ep), 0.0)
            progress = (n * share)[ra]
            gen = np.minimum(rem[active], progress)
            idx = np.flatnonzero(active)
            t_end = clock[ra] + dt[ra] * np.where(progress > 0, gen / np.maximum(progress, 1e-12), 1.0)
            rem[idx] -= gen
            ctx[idx] += gen
            generated += gen.sum()
            curve_t.append(float(np.mean((clock + dt)[has])))
            curve_n.append(generated)
            clock += dt
            busy += dt
            ended = idx[rem[idx] <= 1e-9]
            if len(ended):
                te = t_end[rem[idx] <= 1e-9]
                nxt = turn[ended] + 1
                more = nxt < T
                more[more] = work.lengths[ended[more], nxt[more]] > 0
                cont, stop = ended[more], ended[~more]
                done[stop], finish[stop] = True, te[~more]
                if len(cont):
                    ready[cont] = te[more] + work.env_latency[cont, turn[cont]] * env_factor
                    turn[cont] += 1
                    rem[cont] = work.lengths[cont, turn[cont]]
                    ctx[cont] += work.obs_tokens
                    if work.obs_tokens:  # the observation is prefilled when the episode returns
                        extra = prefill_s(np.bincount(rep[cont], minlength=R) * work.obs_tokens, m, hw, eff, g)
                        clock += extra
                        busy += extra
        # a replica with nothing ready jumps to its next episode's return from the environment
        pending = ~done & (ready > clock[rep] + 1e-12)
        if pending.any():
            idle = np.full(R, np.inf)
            np.minimum.at(idle, rep[pending], ready[pending])
            cnt_now = np.bincount(rep[~done & (ready <= clock[rep] + 1e-12)], minlength=R)
            jump = (cnt_now == 0) & np.isfinite(idle)
            clock[jump] = np.maximum(clock[jump], idle[jump])
    order = np.argsort(curve_t, kind="stable")
    ct, cn = np.asarray(curve_t)[order], np.maximum.accumulate(np.asarray(curve_n)[order])
    return RolloutResult(float(finish.max()) if E else 0.0, finish, busy, round(generated), ct, cn)


def _single_turn(lengths: np.ndarray, rep: np.ndarray, R: int, start: np.ndarray, prompt: int, m: ModelSpec,
                 hw: Accelerator, eff: Efficiency, tp: int, ep: int) -> RolloutResult:
    """The exact rollout when every sequence of a replica decodes at once from the start (one turn, the
    batch bound not reached): sorted by length, the batch shrinks by one at each completion, and between
    two completions every sequence has generated the same tokens, so a segment of s iterations at batch
    b costs s x iteration(b, b x (prompt + mid-segment position)). One [replicas, sequences] array pass."""
    counts = np.bincount(rep, minlength=R)
    n = int(counts.max())
    order = np.lexsort((lengths, rep))
    col = np.arange(len(lengths)) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(n - counts, counts)
    mat = np.zeros((R, n))
    mat[rep[order], col] = lengths[order]  # each row ascending, zeros in front for the replicas with fewer
    prev = np.concatenate([np.zeros((R, 1)), mat[:, :-1]], axis=1)
    b = (n - np.arange(n))[None, :].repeat(R, axis=0).astype(float)
    seg = mat - prev
    dt = np.where(seg > 0, seg * decode_iter_s(b, b * (prompt + (prev + mat) / 2), m, hw, eff, tp, ep), 0.0)
    t_end = start[:, None] + np.cumsum(dt, axis=1)
    finish = np.empty(len(lengths))
    finish[order] = t_end[rep[order], col]
    tok = np.cumsum(np.concatenate([np.zeros((R, 1)), mat[:, :-1]], axis=1), axis=1) + b * mat  # generated by t_end
    grid = np.linspace(0.0, float(t_end.max()), 33)
    pts_t = np.concatenate([start[:, None], t_end], axis=1)  # [R, n+1], each row non-decreasing
    pts_v = np.concatenate([np.zeros((R, 1)), tok], axis=1)
    k = np.clip((pts_t[:, :, None] <= grid[None, None, :]).sum(axis=1) - 1, 0, n - 1)  # [R, 33]
    rows = np.arange(R)[:, None]
    t0, t1 = pts_t[rows, k], pts_t[rows, k + 1]
    frac = np.clip((grid[None, :] - t0) / np.maximum(t1 - t0, 1e-12), 0.0, 1.0)
    curve = (pts_v[rows, k] + frac * (pts_v[rows, k + 1] - pts_v[rows, k])).sum(axis=0)
    busy = t_end[:, -1].copy()
    return RolloutResult(float(t_end.max()), finish, busy, int(lengths.sum()), grid, np.maximum.accumulate(curve))


def stream_rollout_s(work: StepWork, n_rep: int, m: ModelSpec, hw: Accelerator, eff: Efficiency, tp: int, ep: int,
                     max_batch: int, steps_in_flight: int = 1) -> tuple[float, np.ndarray]:
    """The what-if of a streaming loop (AReaL): engines never wait for a step's tail, the next steps'
    requests keep every replica's batch as full as the staleness bound allows (`steps_in_flight` =
    k+1 steps of episodes at most), so a step costs its tokens at that batch's rate.
    Returns (seconds, busy seconds per replica)."""
    tokens = work.lengths.sum()
    per_rep = tokens / n_rep
    mean_ctx = work.prompt_tokens + work.lengths.sum(axis=1).mean() / 2
    b = float(min(max_batch, steps_in_flight * work.episodes / n_rep))
    it = float(decode_iter_s(np.array([b]), np.array([b * mean_ctx]), m, hw, eff, tp, ep)[0])
    pre = float(prefill_s(np.array([work.episodes * work.prompt_tokens / n_rep]), m, hw, eff, tp * ep)[0])
    t = per_rep / b * it + pre
    return t, np.full(n_rep, t)
