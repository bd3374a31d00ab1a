"""A step's health checks, in one place: what makes a run warn, and what makes it stop.

Three calls, at fixed points of the step (tidal/runtime/controller.py, `Controller._learn`):

    before_update   the episodes that failed are logged; more than `reward.failure_budget`
                    of them for `reward.failure_steps` steps in a row stops the run before it
                    trains on the survivors of a broken reward or environment
    watch           the reward-hacking monitors (`reward.monitors`) and the alerts
                    (`alerts`) read the step's metrics; what fires goes into the metrics, a
                    warning, RUN/hacking_events.jsonl and RUN/events.jsonl (with the roles
                    replaced during the step)
    enforce         after the step's metrics are written: `train.max_nonfinite_steps` steps in a
                    row whose update was skipped for a NaN or inf gradient, or an alert named in
                    `alerts.stop_on`, stops the run

A stop is `RunFailed`, naming the step, the cause and the last checkpoint, which stays intact:
a step over the failure budget or with a skipped update is not checkpointed (`healthy`), so the
rotation keeps the checkpoints of good steps.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from tidal.config import TidalConfig
from tidal.durable import append_lines
from tidal.monitor.alerts import AlertEvent, Alerts
from tidal.monitor.hacking import HackingMonitor
from tidal.runtime.run_dir import RunFailed
from tidal.types import Episode

__all__ = ["Health", "RunFailed", "role_restarts"]

log = logging.getLogger("tidal")
FAILURE_STATUSES = ("env_error", "reward_error", "engine_error", "timeout")


def role_restarts(roles, step: int) -> list[dict]:
    """The engine replicas and env workers replaced since the last call, as `restart` events
    of `step` (`Health.watch` writes them to RUN/events.jsonl with the step's alerts)."""
    out = []
    for source in (roles.pusher, roles.envs):
        pending = getattr(source, "restart_events", None)
        while pending:
            out.append({"kind": "restart", "step": step, **pending.pop(0)})
    return out


_WHERE = re.compile(r" on episode \S+ \(task [^)]*\) of step \d+")


def _others(eps: list[Episode], most: int = 3) -> str:
    """The distinct errors among `eps` beyond the first one's, with their counts: a flaky
    reward's step is one line, not a traceback per episode (their tracebacks: once a step)."""
    counts = Counter(_WHERE.sub("", e.error) for e in eps)
    if len(counts) == 1:
        return f" (all {len(eps)} the same error)" if len(eps) > 1 else ""
    first = _WHERE.sub("", eps[0].error)
    rest = [(n, err) for err, n in counts.most_common() if err != first]
    text = "; ".join(f"{n} x {err}" for n, err in rest[:most])
    more = f"; and {len(rest) - most} more distinct errors" if len(rest) > most else ""
    return f" ({counts[first]} x that error; also {text}{more})"


class Health:
    """`root`: the run directory (its event files); `last_checkpoint()`: the newest complete
    checkpoint or None, named in every stop; `roles`: the run's roles (their replacements)."""

    def __init__(self, cfg: TidalConfig, root: Path, last_checkpoint: Callable[[], Path | None], roles=None):
        self.cfg, self.root, self.last_checkpoint, self.roles = cfg, root, last_checkpoint, roles
        self.monitor = HackingMonitor(**cfg.reward.monitor_args) if cfg.reward.monitors else None
        self.alerts = Alerts(cfg.alerts) if cfg.alerts.enabled else None
        self.over_budget = 0  # consecutive steps over the failure budget
        self.nonfinite = 0  # consecutive steps with a non-finite gradient (their updates skipped)

    @property
    def healthy(self) -> bool:
        """Whether the last step may be checkpointed."""
        return not self.over_budget and not self.nonfinite

    def _last(self) -> str:
        return str(self.last_checkpoint() or "none (no step was saved yet)")

    # -- before the update -------------------------------------------------------------------
    def before_update(self, step: int, episodes: list[Episode], metrics: dict[str, float],
                      log_metrics: Callable[[int, dict], None]) -> None:
        """Log the step's failed episodes; stop the run (after `log_metrics` wrote the step's
        metrics with `stopped/failure_budget`) when the failure budget is spent."""
        failed_by: dict[str, list[Episode]] = {}
        for e in episodes:
            if not e.status.trainable:
                failed_by.setdefault(e.status.value, []).append(e)
        for status, eps in failed_by.items():
            log.warning("step %d: %d of %d episodes ended %s (not trained on); first: %s%s",
                        step, len(eps), len(episodes), status, eps[0].error, _others(eps))
        rc = self.cfg.reward
        failed = metrics.get("episodes/failed_frac", 0.0)
        self.over_budget = self.over_budget + 1 if episodes and failed > rc.failure_budget else 0
        if self.over_budget < rc.failure_steps:
            return
        by_status = {k.split("/", 1)[1]: int(v) for k, v in metrics.items()
                     if k.startswith("episodes/") and k.split("/", 1)[1] in FAILURE_STATUSES and v}
        first = next((e.error for e in episodes if not e.status.trainable), "")
        last = self._last()
        log_metrics(step, {**metrics, "stopped/failure_budget": 1.0})
        raise RunFailed(
            f"stopping at step {step}: {failed:.0%} of this step's episodes failed ({by_status}), over "
            f"reward.failure_budget={rc.failure_budget:g} for {self.over_budget} steps in a row "
            f"(reward.failure_steps={rc.failure_steps}). First error: {first}. Nothing of step {step} was "
            f"trained on; the last checkpoint is {last}.")

    # -- watching the step's metrics -----------------------------------------------------------
    def watch(self, step: int, episodes: list[Episode], metrics: dict[str, float]) -> list[AlertEvent]:
        """The monitors and alerts over this step (their findings added to `metrics`); the
        alerts that fired."""
        events = []
        if self.monitor is not None:
            events = self.monitor.update(step, episodes, metrics)
            metrics.update(self.monitor.metrics_of(events))
            if events:
                append_lines(self.root / "hacking_events.jsonl", [json.dumps(e.to_dict()) + "\n" for e in events])
        fired = self.alerts.update(step, metrics, events) if self.alerts is not None else []
        restarts = role_restarts(self.roles, step) if self.roles is not None else []
        if lines := [a.to_dict() for a in fired] + restarts:  # recorded before it is said: a full disk names this file
            append_lines(self.root / "events.jsonl", [json.dumps(e) + "\n" for e in lines])
        for a in fired:
            metrics[f"alerts/{a.alert}"] = 1.0
            log.warning("alert %s at step %d: %s", a.alert, step, a.message)
        return fired

    # -- after the step's metrics are written ------------------------------------------------------
    def enforce(self, step: int, metrics: dict[str, float], fired: list[AlertEvent]) -> None:
        """Non-finite gradients skip their update; a run that keeps producing them stops, with
        its last checkpoint (from before them) intact, instead of skipping forever. An alert of
        `alerts.stop_on` stops the run without checkpointing the step."""
        self.nonfinite = self.nonfinite + 1 if metrics.get("skipped_step", 0.0) > 0 else 0
        limit = self.cfg.train.max_nonfinite_steps
        if self.nonfinite >= limit:
            raise RunFailed(
                f"stopping at step {step}: the gradient was NaN or inf in {self.nonfinite} steps in a row "
                f"(train.max_nonfinite_steps={limit}; grad_norm {metrics.get('grad_norm')}, loss "
                f"{metrics.get('loss')}); their updates were skipped. Lower train.lr or check the rewards and "
                f"log-probs of these steps' episodes. The last checkpoint is {self._last()}.")
        stopping = [a for a in fired if a.alert in self.cfg.alerts.stop_on]
        if stopping:
            raise RunFailed(f"stopping at step {step} on alert {stopping[0].alert} (alerts.stop_on): "
                            f"{stopping[0].message}. Step {step} was not checkpointed; the last checkpoint is "
                            f"{self._last()}.")
