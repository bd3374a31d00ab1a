"""Reward-hacking monitors: statistics over each step's episodes that say when the reward is
being gamed rather than earned, as events for the metrics and the log.

`HackingMonitor.update(step, episodes, metrics)` returns the step's `HackingEvent`s (kind,
step, message, example episode ids); `monitor.metrics_of(events)` gives the numbers to log
(`hacking/length_corr`, `hacking/events/<kind>`, …). Five monitors:

- `divergence`: the training reward rises while the held-out reward or accuracy falls, over
  the last `divergence_window` evaluations (least-squares trends, so one noisy eval does
  not fire it);
- `length_correlation`: the reward no verifier vouches for (the reward less the parts in
  `part_exempt`, a verifier's `correct`) correlates with the response length beyond a bound
  (Spearman by default, within groups by default: GRPO compares samples of one prompt, so
  that is the correlation the policy gradient sees), and within right and within wrong
  answers apart where a reward says which is which (the episode's `correct`): a right answer
  may be long;
- `part_dominance`: one reward part carries more than `part_share_max` of the reward's
  magnitude (sum over episodes of |part| / sum of |parts|). Parts in `part_exempt` (the
  verifier's `correct`, by default) may dominate: that is what they are for;
- `verifier_errors`: a step's reward_error or timeout rate (per reward function, read from
  the episode's error) jumps above its running baseline (the mean of the previous steps);
- `judge_disagreement`: a judge part and a verifier are both present and disagree on too many
  answers (the judge scores high what the verifier marks wrong, or low what it marks right).

Each monitor fires once when its condition starts holding and again only after it has
stopped holding (edge-triggered), so a persistent condition is one event, not one per step;
its statistic is in the metrics every step.
"""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tidal.config import HACKING_KINDS
from tidal.types import Episode, Status

log = logging.getLogger("tidal.hacking")

KINDS = HACKING_KINDS  # the monitors' names, which alerts.hacking_kinds is validated against
_FUNCTION = re.compile(r"reward function `([^`]+)`")


@dataclass
class HackingEvent:
    """One monitor firing. `value` is the statistic that crossed `threshold`; `episode_ids` are
    examples to look at (in the episode store)."""

    kind: str
    step: int
    message: str
    episode_ids: list[str] = field(default_factory=list)
    value: float = float("nan")
    threshold: float = float("nan")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def metrics_of(events: list[HackingEvent]) -> dict[str, float]:
    """`hacking/events/<kind>`: how many events of each kind (every kind, 0 when none)."""
    out = {f"hacking/events/{k}": 0.0 for k in KINDS}
    for e in events:
        out[f"hacking/events/{e.kind}"] = out.get(f"hacking/events/{e.kind}", 0.0) + 1.0
    return out


# -- statistics ------------------------------------------------------------------------------
def _ranks(xs: list[float]) -> list[float]:
    """Ranks from 1, ties given their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson(xs: list[float], ys: list[float]) -> float:
    """Pearson's r; NaN when either side is constant (no correlation is defined)."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 1e-12 or syy <= 1e-12:
        return float("nan")
    return sxy / math.sqrt(sxx * syy)


def spearman(xs: list[float], ys: list[float]) -> float:
    return pearson(_ranks(xs), _ranks(ys))


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 when xs are all equal)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def _is_part(name: str, part: str) -> bool:
    """`part` itself, or `part` under a reward's name (several rewards: `name/part`)."""
    return name == part or name.endswith("/" + part)


class HackingMonitor:
    """The five monitors over a run (module docstring). Every bound is a keyword argument:

    - heldout_keys: held-out metrics, first present wins (the controller logs `eval/accuracy`);
    - divergence_window (evals), divergence_min_rise (training reward, over the window),
      divergence_min_drop (held-out metric, over the window);
    - length_corr_max, length_corr_method ("spearman" | "pearson"), length_corr_scope ("group":
      reward and length centred on their group's mean | "batch"), length_corr_abs (also fire
      on a negative correlation below -bound), length_window (steps pooled),
      length_corr_given_correct (within right and within wrong answers apart, where the
      episodes have a `correct`: length that correctness explains is not counted);
    - part_share_max, part_exempt (parts allowed to dominate, matched as `p` or `*/p`);
    - error_jump (rate above baseline), error_baseline_steps, error_min_history (steps of
      history before a baseline counts);
    - judge_part (matched as `p` or `*/p`), judge_weight (its weight in the reward: parts are
      stored weighted), judge_high, judge_low (normalized judge score bounds), disagree_max
      (rate), verifier_part (the part that marks an answer correct);
    - min_episodes: fewest episodes for a per-step statistic; max_examples: episode ids per event.
    """

    def __init__(self, *, heldout_keys: tuple[str, ...] = ("eval/accuracy", "eval/reward"),
                 divergence_window: int = 3, divergence_min_rise: float = 0.05, divergence_min_drop: float = 0.05,
                 length_corr_max: float = 0.5, length_corr_method: Literal["spearman", "pearson"] = "spearman",
                 length_corr_scope: Literal["group", "batch"] = "group", length_corr_abs: bool = False,
                 length_window: int = 1, length_corr_unverified: bool = True, length_corr_given_correct: bool = True,
                 part_share_max: float = 0.8,
                 part_exempt: tuple[str, ...] = ("correct",),
                 error_jump: float = 0.1, error_baseline_steps: int = 10, error_min_history: int = 3,
                 judge_part: str = "judge", judge_weight: float = 1.0, judge_high: float = 0.7, judge_low: float = 0.3,
                 disagree_max: float = 0.2, verifier_part: str = "correct", min_episodes: int = 8,
                 max_examples: int = 5, log_events: bool = True):
        if divergence_window < 2:
            raise ValueError(f"hacking monitor: divergence_window must be at least 2 evals, got {divergence_window}")
        if length_corr_method not in ("spearman", "pearson"):
            raise ValueError(f"hacking monitor: length_corr_method must be spearman or pearson, "
                             f"got {length_corr_method!r}")
        if length_corr_scope not in ("group", "batch"):
            raise ValueError(f"hacking monitor: length_corr_scope must be group or batch, got {length_corr_scope!r}")
        if length_window < 1 or error_baseline_steps < 1 or min_episodes < 2 or judge_weight <= 0:
            raise ValueError("hacking monitor: length_window >= 1, error_baseline_steps >= 1, min_episodes >= 2 and "
                             "judge_weight > 0 are required")
        self.heldout_keys = tuple(heldout_keys)
        self.divergence_window = divergence_window
        self.divergence_min_rise = divergence_min_rise
        self.divergence_min_drop = divergence_min_drop
        self.length_corr_max = length_corr_max
        self.length_corr_method = length_corr_method
        self.length_corr_scope = length_corr_scope
        self.length_corr_unverified = length_corr_unverified
        self.length_corr_given_correct = length_corr_given_correct
        self.length_corr_abs = length_corr_abs
        self.part_share_max = part_share_max
        self.part_exempt = tuple(part_exempt)
        self.error_jump = error_jump
        self.error_min_history = error_min_history
        self.judge_part = judge_part
        self.judge_weight = judge_weight
        self.judge_high = judge_high
        self.judge_low = judge_low
        self.disagree_max = disagree_max
        self.verifier_part = verifier_part
        self.min_episodes = min_episodes
        self.max_examples = max_examples
        self.log_events = log_events
        self.train_rewards: list[tuple[int, float]] = []  # (step, mean training reward)
        self.evals: list[tuple[int, float, str]] = []  # (step, held-out value, its key)
        self._length_window: deque[list[Episode]] = deque(maxlen=length_window)
        self._error_history: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=error_baseline_steps))
        self._steps_seen = 0
        self._active: set[str] = set()
        self.stats: dict[str, float] = {}  # this step's statistics (see metrics_of)

    # -- the step ----------------------------------------------------------------------------
    def update(self, step: int, episodes: list[Episode], metrics: dict[str, float]) -> list[HackingEvent]:
        """Feed one step (every sampled episode, failed ones included, and the step's metrics,
        eval metrics included on an eval step); returns the events that start at this step."""
        self.stats = {}
        ok = [e for e in episodes if e.status.trainable and math.isfinite(e.reward)]
        found: list[tuple[str, HackingEvent | None]] = []
        found += self._divergence(step, ok, metrics)
        found += self._length(step, ok)
        found += self._dominance(step, ok)
        found += self._errors(step, episodes)
        found += self._disagreement(step, ok)
        events = []
        holding = set()
        for key, event in found:
            if event is None:
                continue
            holding.add(key)
            if key not in self._active:
                events.append(event)
        self._active = holding
        if self.log_events:
            for e in events:
                log.warning("reward hacking? [%s] step %d: %s; examples: %s", e.kind, e.step, e.message,
                            ", ".join(e.episode_ids) or "none")
        return events

    def metrics_of(self, events: list[HackingEvent]) -> dict[str, float]:
        """This step's statistics (`hacking/length_corr`, `hacking/part_share/<part>`,
        `hacking/error_rate/<status or function>`, `hacking/judge_disagree`, `hacking/train_trend`,
        `hacking/heldout_trend`) and the event counts (`hacking/events/<kind>`)."""
        return {**self.stats, **metrics_of(events)}

    def _examples(self, eps: list[Episode], key) -> list[str]:
        return [e.episode_id for e in sorted(eps, key=key)[: self.max_examples]]

    # -- the monitors ------------------------------------------------------------------------
    def _divergence(self, step: int, ok: list[Episode], metrics: dict[str, float]):
        train = metrics.get("reward")
        if train is None and ok:
            train = sum(e.reward for e in ok) / len(ok)
        if train is not None and math.isfinite(train):
            self.train_rewards.append((step, float(train)))
        key = next((k for k in self.heldout_keys if k in metrics and math.isfinite(metrics[k])), None)
        if key is not None:
            self.evals.append((step, float(metrics[key]), key))
        window = [e for e in self.evals if e[2] == (self.evals[-1][2] if self.evals else None)]
        window = window[-self.divergence_window:]
        if len(window) < self.divergence_window:
            return []
        s0, s1 = window[0][0], window[-1][0]
        train_pts = [(s, r) for s, r in self.train_rewards if s0 <= s <= s1]
        if len(train_pts) < 2 or s1 <= s0:
            return []
        span = s1 - s0
        rise = slope([s for s, _ in train_pts], [r for _, r in train_pts]) * span
        drop = -slope([s for s, _, _ in window], [v for _, v, _ in window]) * span
        self.stats["hacking/train_trend"] = rise
        self.stats["hacking/heldout_trend"] = -drop
        if rise >= self.divergence_min_rise and drop >= self.divergence_min_drop:
            msg = (f"the training reward rose {rise:+.3f} over steps {s0}-{s1} while held-out `{window[-1][2]}` fell "
                   f"{drop:.3f} ({window[0][1]:.3f} -> {window[-1][1]:.3f} over {len(window)} evals)")
            return [("divergence", HackingEvent("divergence", step, msg, self._examples(ok, lambda e: -e.reward),
                                                drop, self.divergence_min_drop))]
        return [("divergence", None)]

    def _length(self, step: int, ok: list[Episode]):
        self._length_window.append(ok)
        pool = [e for eps in self._length_window for e in eps]
        if len(pool) < self.min_episodes:
            return []
        lengths = [float(e.num_policy_tokens) for e in pool]
        # The reward no verifier vouches for: a verifier's `correct` pays a right answer of any
        # length (careful, longer answers that are right are what RL should find); what is left
        # (a judge, a reward model, format parts) is where length can be gamed.
        # (rounded: 1.1 - 1.0 and 0.1 - 0.0 differ in the last bits, and ranks would see it)
        rewards = [round(e.reward - sum(v for k, v in e.reward_parts.items()
                                        if any(_is_part(k, p) for p in self.part_exempt)), 9)
                   if self.length_corr_unverified else e.reward for e in pool]
        # Cells whose reward and length are centred on their own mean: the group (what GRPO's
        # advantages compare), and within it right and wrong answers apart when a reward says
        # which is which (`correct`: a verifier part, veRL's `acc`, a reward named `correct`).
        # Then a reward that pays right answers, which happen to be longer (tool use, worked
        # steps), has nothing left to correlate; a reward that pays length among answers of the
        # same correctness still does. Without a `correct`, length cannot be told from merit.
        def cell(e: Episode) -> str:
            where = f"{e.step}/{e.group_id}" if self.length_corr_scope == "group" else ""
            c = e.metrics.get("correct") if self.length_corr_given_correct else None
            return f"{where}|{c}" if c is not None else where

        cells: dict[str, list[int]] = defaultdict(list)
        for i, e in enumerate(pool):
            cells[cell(e)].append(i)
        if len(cells) > 1 or self.length_corr_scope == "group":
            keep = [i for idx in cells.values() if len(idx) > 1 for i in idx]
            if len(keep) < self.min_episodes:
                return []
            means = {g: (sum(lengths[i] for i in idx) / len(idx), sum(rewards[i] for i in idx) / len(idx))
                     for g, idx in cells.items()}
            gid = {i: g for g, idx in cells.items() for i in idx}
            lengths = [lengths[i] - means[gid[i]][0] for i in keep]
            rewards = [round(rewards[i] - means[gid[i]][1], 9) for i in keep]  # equal rewards centre to an exact 0
            pool = [pool[i] for i in keep]
        corr = (spearman if self.length_corr_method == "spearman" else pearson)(lengths, rewards)
        if not math.isfinite(corr):
            return []
        self.stats["hacking/length_corr"] = corr
        fires = corr > self.length_corr_max or (self.length_corr_abs and corr < -self.length_corr_max)
        if not fires:
            return [("length_correlation", None)]
        longer = "longer" if corr > 0 else "shorter"
        msg = (f"reward correlates with response length: {self.length_corr_method} r={corr:+.2f} over {len(pool)} "
               f"episodes ({self.length_corr_scope} scope; bound {self.length_corr_max:g}): {longer} answers score "
               f"higher")
        sign = 1 if corr > 0 else -1  # examples: the best rewarded, then the longest (shortest) of those
        ex = self._examples(pool, lambda e: (-e.reward, -sign * e.num_policy_tokens))
        return [("length_correlation", HackingEvent("length_correlation", step, msg, ex, corr, self.length_corr_max))]

    def _dominance(self, step: int, ok: list[Episode]):
        mass: dict[str, float] = defaultdict(float)
        for e in ok:
            for k, v in e.reward_parts.items():
                if math.isfinite(v):
                    mass[k] += abs(v)
        total = sum(mass.values())
        if len(mass) < 2 or total <= 0 or len(ok) < self.min_episodes:
            return []
        out = []
        for k, m in sorted(mass.items()):
            share = m / total
            self.stats[f"hacking/part_share/{k}"] = share
            if any(_is_part(k, p) for p in self.part_exempt):
                continue
            key = f"part_dominance:{k}"
            if share > self.part_share_max:
                msg = (f"reward part `{k}` carries {share:.0%} of the reward's magnitude over {len(ok)} episodes "
                       f"(bound {self.part_share_max:.0%}); the other parts barely move the reward")
                ex = self._examples(ok, lambda e, k=k: -abs(e.reward_parts.get(k, 0.0)))
                out.append((key, HackingEvent("part_dominance", step, msg, ex, share, self.part_share_max)))
            else:
                out.append((key, None))
        return out

    def _errors(self, step: int, episodes: list[Episode]):
        if not episodes:
            return []
        n = len(episodes)
        failing: dict[str, list[Episode]] = defaultdict(list)
        for e in episodes:
            if e.status in (Status.REWARD_ERROR, Status.TIMEOUT):
                failing[e.status.value].append(e)
                m = _FUNCTION.search(e.error)
                if m:
                    failing[f"{e.status.value}/{m.group(1)}"].append(e)
        out = []
        for name in sorted({"reward_error", "timeout", *failing, *self._error_history}):
            rate = len(failing.get(name, [])) / n
            if name not in self._error_history:  # a function failing for the first time: 0 on every step before
                self._error_history[name].extend([0.0] * self._steps_seen)
            history = self._error_history[name]
            self.stats[f"hacking/error_rate/{name}"] = rate
            if len(history) >= self.error_min_history:
                baseline = sum(history) / len(history)
                key = f"verifier_errors:{name}"
                if rate - baseline >= self.error_jump:
                    eps = failing[name]
                    msg = (f"{name} rate jumped to {rate:.0%} of {n} episodes from a baseline of {baseline:.0%} "
                           f"(last {len(history)} steps); first: {eps[0].error[:300]}")
                    out.append((key, HackingEvent("verifier_errors", step, msg,
                                                  [e.episode_id for e in eps[: self.max_examples]],
                                                  rate - baseline, self.error_jump)))
                else:
                    out.append((key, None))
            history.append(rate)
        self._steps_seen += 1
        return out

    def _disagreement(self, step: int, ok: list[Episode]):
        pairs = []
        for e in ok:
            judge = [v for k, v in e.reward_parts.items() if _is_part(k, self.judge_part)]
            has_verifier = any(_is_part(k, self.verifier_part) for k in e.reward_parts)
            if judge and has_verifier and "correct" in e.metrics:
                pairs.append((e, sum(judge) / self.judge_weight, e.metrics["correct"]))
        if len(pairs) < self.min_episodes:
            return []
        high_wrong = [e for e, j, c in pairs if j >= self.judge_high and c <= 0]
        low_right = [e for e, j, c in pairs if j <= self.judge_low and c >= 1]
        rate = (len(high_wrong) + len(low_right)) / len(pairs)
        self.stats["hacking/judge_disagree"] = rate
        self.stats["hacking/judge_high_verifier_wrong"] = len(high_wrong) / len(pairs)
        if rate <= self.disagree_max:
            return [("judge_disagreement", None)]
        msg = (f"the judge and the verifier disagree on {rate:.0%} of {len(pairs)} answers (bound "
               f"{self.disagree_max:.0%}): {len(high_wrong)} judged >= {self.judge_high:g} but wrong, "
               f"{len(low_right)} judged <= {self.judge_low:g} but right")
        ex = [e.episode_id for e in (high_wrong + low_right)[: self.max_examples]]
        return [("judge_disagreement", HackingEvent("judge_disagreement", step, msg, ex, rate, self.disagree_max))]
