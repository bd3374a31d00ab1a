"""Health alerts: what a person watching a long run's curves would catch, caught by the run.

`Alerts.update(step, metrics, hacking_events)` reads the step's metrics (the keys of
docs/metrics.md) and returns the alerts that fired. Each is edge-triggered, as the hacking
monitors are: it fires on the step its condition starts holding and again only after a step
where it did not hold, so a lasting condition is one event. Rules that compare with the run's
own past wait for `warmup_steps` steps of it; "the recent median" is over the previous
`window` steps. Thresholds are `alerts.*` (AlertsConfig), each on by default with a value
that the default job never reaches (tests/test_alerts.py runs it).

| alert | fires when |
| --- | --- |
| `entropy_collapse` | `entropy` < `entropy_collapse_ratio` × its warm-up mean while the mean `reward` of the last `warmup_steps` steps is no more than `entropy_collapse_reward_margin` above its warm-up mean (a policy that turned deterministic without getting better; the default job's entropy falls 15× as its reward rises, which is convergence) |
| `kl_spike` | `kl` > `kl_spike_factor` × its recent median (of the nonzero values) and > `kl_spike_min` |
| `grad_norm_spike` | `grad_norm` > `grad_norm_spike_factor` × its recent median (of the nonzero values: a step whose groups all agree has no gradient) and > `grad_norm_spike_min` |
| `mismatch_growth` | `mismatch_kl` > `mismatch_growth_factor` × its warm-up mean and > `mismatch_min` |
| `staleness_over_bound` | `staleness/over_bound` > 0: tokens staler than `rollout.max_staleness` were trained on |
| `failure_rate_jump` | `episodes/failed_frac` > its recent median + `failure_jump` |
| `tool_error_rate_jump` | `tools/error_rate` > its recent median + `tool_error_jump` |
| `throughput_drop` | `tokens_per_s` < `throughput_drop_ratio` × its recent median for `throughput_drop_steps` steps in a row |
| `no_learning_signal` | `groups/zero_std_frac` = 1 (every group's samples got the same reward: no advantage, no gradient) for `no_signal_steps` steps in a row |
| `reward_up_eval_down` | the `divergence` hacking monitor fired: the training reward's trend rises while held-out accuracy's falls (needs `reward.monitors`) |
| `reward_hacking` | another hacking monitor of `hacking_kinds` fired (part dominance, verifier errors, judge disagreement; length correlation is left out by default: it fires on the healthy default job) |
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class AlertEvent:
    """One alert firing: `value` crossed `threshold` at `step`."""

    alert: str
    step: int
    message: str
    value: float
    threshold: float
    time: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "alert", **asdict(self)}


Check = Callable[[dict[str, float]], "tuple[bool, float, float, str] | None"]


class Alerts:
    """The run's alerts, fed one step at a time. `cfg` is an AlertsConfig."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.history: dict[str, deque[float]] = {}
        self.warmup: dict[str, list[float]] = {}
        self.active: set[str] = set()  # alerts whose condition held at the last step
        self.low_throughput = 0
        self.no_signal = 0  # steps in a row whose groups all had equal rewards
        self.rules: dict[str, Check] = {
            "entropy_collapse": self._entropy_collapse, "kl_spike": self._kl_spike,
            "grad_norm_spike": self._grad_norm_spike, "mismatch_growth": self._mismatch_growth,
            "staleness_over_bound": self._staleness, "failure_rate_jump": self._failure_jump,
            "tool_error_rate_jump": self._tool_error_jump, "throughput_drop": self._throughput_drop,
            "no_learning_signal": self._no_learning_signal,
        }

    def update(self, step: int, metrics: dict[str, Any], hacking_events: list | None = None) -> list[AlertEvent]:
        values = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        holding: dict[str, tuple[float, float, str]] = {}
        for name, rule in self.rules.items():
            verdict = rule(values)
            if verdict is not None and verdict[0]:
                holding[name] = verdict[1:]
        for event in hacking_events or []:
            if event.kind not in self.cfg.hacking_kinds:
                continue
            name = "reward_up_eval_down" if event.kind == "divergence" else "reward_hacking"
            if name not in holding:
                holding[name] = (event.value, event.threshold, f"hacking monitor `{event.kind}`: {event.message}")
        self._remember(values)
        fired = []
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        for name, (value, threshold, message) in holding.items():
            # Hacking events are edge-triggered by their monitor already; each one is an alert.
            if name not in self.active or name in ("reward_up_eval_down", "reward_hacking"):
                fired.append(AlertEvent(name, step, message, value, threshold, now))
        self.active = set(holding)
        return fired

    # -- state ---------------------------------------------------------------------------------
    def _remember(self, values: dict[str, float]) -> None:
        for key in ("entropy", "reward", "kl", "grad_norm", "mismatch_kl", "episodes/failed_frac",
                    "tools/error_rate", "tokens_per_s"):
            if key not in values:
                continue
            warm = self.warmup.setdefault(key, [])
            if len(warm) < self.cfg.warmup_steps:
                warm.append(values[key])
            self.history.setdefault(key, deque(maxlen=self.cfg.window)).append(values[key])

    def _baseline(self, key: str) -> float | None:
        """The warm-up mean of `key`, once the warm-up is complete."""
        warm = self.warmup.get(key, [])
        return statistics.fmean(warm) if len(warm) >= self.cfg.warmup_steps else None

    def _recent_median(self, key: str) -> float | None:
        past = self.history.get(key, ())
        return statistics.median(past) if len(past) >= self.cfg.warmup_steps else None

    # -- rules: (holds, value, threshold, message) or None when the metric is absent ------------
    def _entropy_collapse(self, v: dict[str, float]):
        c = self.cfg
        base, reward_base = self._baseline("entropy"), self._baseline("reward")
        if "entropy" not in v or base is None or reward_base is None or base <= 0:
            return None
        recent = list(self.history.get("reward", ()))[-(c.warmup_steps - 1):] + [v.get("reward", reward_base)]
        reward_now = statistics.fmean(recent)
        threshold = c.entropy_collapse_ratio * base
        holds = v["entropy"] < threshold and reward_now <= reward_base + c.entropy_collapse_reward_margin
        return holds, v["entropy"], threshold, (
            f"entropy {v['entropy']:.4g} nats/token is below {c.entropy_collapse_ratio:g}× its warm-up mean "
            f"{base:.4g} while the reward ({reward_now:.3f} over the last {len(recent)} steps, warm-up "
            f"{reward_base:.3f}) did not improve: the policy is collapsing onto a few outputs")

    def _spike(self, v: dict[str, float], key: str, factor: float, floor: float, what: str):
        # Against the median of the nonzero values: late in a GRPO run most groups carry no
        # signal (every sample right), their steps' gradient is 0, and a median of zeros would
        # make any step with signal a "spike".
        past = [x for x in self.history.get(key, ()) if x > 0]
        median = statistics.median(past) if len(past) >= self.cfg.warmup_steps else None
        if key not in v or median is None:
            return None
        threshold = max(factor * median, floor)
        return v[key] > threshold, v[key], threshold, (
            f"{what} {v[key]:.4g} is over {factor:g}× its median {median:.4g} of the last {len(past)} nonzero "
            f"steps" + (f" (and over {floor:g})" if floor else ""))

    def _kl_spike(self, v: dict[str, float]):
        return self._spike(v, "kl", self.cfg.kl_spike_factor, self.cfg.kl_spike_min, "kl")

    def _grad_norm_spike(self, v: dict[str, float]):
        return self._spike(v, "grad_norm", self.cfg.grad_norm_spike_factor, self.cfg.grad_norm_spike_min, "grad_norm")

    def _mismatch_growth(self, v: dict[str, float]):
        c = self.cfg
        base = self._baseline("mismatch_kl")
        if "mismatch_kl" not in v or base is None:
            return None
        threshold = max(c.mismatch_growth_factor * base, c.mismatch_min)
        return v["mismatch_kl"] > threshold, v["mismatch_kl"], threshold, (
            f"engine/trainer mismatch_kl {v['mismatch_kl']:.4g} nats/token is over {c.mismatch_growth_factor:g}× its "
            f"warm-up mean {base:.4g} and over {c.mismatch_min:g}: the engine no longer samples what the trainer scores "
            "(weight sync, precision or sampling settings)")

    def _staleness(self, v: dict[str, float]):
        if "staleness/over_bound" not in v:
            return None
        return v["staleness/over_bound"] > 0, v["staleness/over_bound"], 0.0, (
            f"{v['staleness/over_bound']:.1%} of the trained tokens were staler than rollout.max_staleness")

    def _jump(self, v: dict[str, float], key: str, jump: float, what: str):
        median = self._recent_median(key)
        if key not in v or median is None:
            return None
        threshold = median + jump
        return v[key] > threshold, v[key], threshold, (
            f"{what} {v[key]:.3f} jumped over its median {median:.3f} of the last {len(self.history[key])} steps "
            f"by more than {jump:g}")

    def _failure_jump(self, v: dict[str, float]):
        return self._jump(v, "episodes/failed_frac", self.cfg.failure_jump, "the failed-episode fraction")

    def _tool_error_jump(self, v: dict[str, float]):
        return self._jump(v, "tools/error_rate", self.cfg.tool_error_jump, "the tool-call error rate")

    def _throughput_drop(self, v: dict[str, float]):
        c = self.cfg
        median = self._recent_median("tokens_per_s")
        if "tokens_per_s" not in v or median is None:
            return None
        threshold = c.throughput_drop_ratio * median
        self.low_throughput = self.low_throughput + 1 if v["tokens_per_s"] < threshold else 0
        return self.low_throughput >= c.throughput_drop_steps, v["tokens_per_s"], threshold, (
            f"tokens_per_s {v['tokens_per_s']:.0f} has been under {c.throughput_drop_ratio:g}× its median "
            f"{median:.0f} for {self.low_throughput} steps")

    def _no_learning_signal(self, v: dict[str, float]):
        if "groups/zero_std_frac" not in v:
            return None
        c = self.cfg
        self.no_signal = self.no_signal + 1 if v["groups/zero_std_frac"] >= 1.0 else 0
        reward = v.get("reward")
        why = ("every answer is rewarded alike: the task may be too hard for the model (all wrong), the reward may "
               "never pay (read a few episodes: `tidal episodes`), or the task is learned (all right)")
        return self.no_signal >= c.no_signal_steps, v["groups/zero_std_frac"], 1.0, (
            f"for {self.no_signal} steps in a row every group's samples got the same reward"
            + (f" (mean reward {reward:.3g})" if reward is not None else "")
            + f": GRPO's advantages are 0 and nothing is learned; {why}")
