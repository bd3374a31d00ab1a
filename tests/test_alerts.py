"""Health alerts (tidal/monitor/alerts.py): each rule fires on the step its condition starts
holding, once, and again only after it stopped holding; the default job fires none; a run
provoked into an alert records it everywhere, and alerts.stop_on stops it with its checkpoint."""

from __future__ import annotations

import json

import pytest

from tidal.config import ALERTS, AlertsConfig, ConfigError, load_config
from tidal.monitor.alerts import Alerts
from tidal.monitor.hacking import HackingEvent
from tidal.runtime.controller import Controller, RunFailed


def healthy(step: int) -> dict[str, float]:
    """A run that learns: reward up, entropy slowly down, steady noise elsewhere."""
    wobble = (step % 3 - 1) * 0.05  # deterministic noise of ±5%
    return {"reward": 0.5 + 0.01 * step, "entropy": 0.05 * (0.97 ** step), "kl": 0.002 * (1 + wobble),
            "grad_norm": 0.3 * (1 + wobble), "mismatch_kl": 1e-4 * (1 + wobble), "episodes/failed_frac": 0.01,
            "tools/error_rate": 0.1 + wobble, "tokens_per_s": 2000 * (1 + wobble), "staleness/over_bound": 0.0,
            "groups/zero_std_frac": 0.5 + wobble}


def provoked(alert: str, step: int) -> dict[str, float]:
    """The healthy run, with `alert`'s condition from step 12 to 14."""
    m = healthy(step)
    if not 12 <= step <= 14:
        return m
    if alert == "entropy_collapse":
        m.update(entropy=0.001, reward=0.5)  # deterministic outputs, and no better than at the start
    elif alert == "kl_spike":
        m["kl"] = 0.5
    elif alert == "grad_norm_spike":
        m["grad_norm"] = 40.0
    elif alert == "mismatch_growth":
        m["mismatch_kl"] = 0.02
    elif alert == "staleness_over_bound":
        m["staleness/over_bound"] = 0.1
    elif alert == "failure_rate_jump":
        m["episodes/failed_frac"] = 0.6
    elif alert == "tool_error_rate_jump":
        m["tools/error_rate"] = 0.7
    elif alert == "throughput_drop":
        m["tokens_per_s"] = 100.0
    elif alert == "no_learning_signal":
        m["groups/zero_std_frac"] = 1.0
    return m


METRIC_RULES = [a for a in ALERTS if a not in ("reward_up_eval_down", "reward_hacking")]


def run_alerts(alert: str, steps: int = 30) -> list:
    alerts = Alerts(AlertsConfig(no_signal_steps=3))  # 3 steps, as the other rule that waits (throughput_drop)
    return [e for step in range(1, steps + 1) for e in alerts.update(step, provoked(alert, step))]


def test_a_healthy_run_fires_nothing():
    alerts = Alerts(AlertsConfig())
    assert [e for step in range(1, 200) for e in alerts.update(step, healthy(step))] == []


@pytest.mark.parametrize("alert", METRIC_RULES)
def test_each_rule_fires_once_when_its_condition_starts(alert):
    fired = run_alerts(alert)
    # throughput_drop and no_learning_signal need 3 steps in a row: 12, 13, 14.
    expected = 14 if alert in ("throughput_drop", "no_learning_signal") else 12
    assert [(e.alert, e.step) for e in fired] == [(alert, expected)], fired
    e = fired[0]
    if alert == "no_learning_signal":
        assert e.value == e.threshold == 1.0 and "same reward" in e.message
    else:
        assert e.value > e.threshold if alert not in ("entropy_collapse", "throughput_drop") else e.value < e.threshold
    assert e.message and e.time


def test_an_alert_fires_again_after_its_condition_stopped():
    alerts = Alerts(AlertsConfig())
    fired = []
    for step in range(1, 40):
        m = healthy(step)
        if step in (12, 13, 20):
            m["kl"] = 0.5
        fired += [e.step for e in alerts.update(step, m)]
    assert fired == [12, 20]


def test_hacking_events_are_alerts():
    alerts = Alerts(AlertsConfig())
    divergence = HackingEvent("divergence", 7, "reward up, held-out down", value=-0.2, threshold=0.0)
    dominance = HackingEvent("part_dominance", 7, "format carries 90%", value=0.9, threshold=0.8)
    fired = alerts.update(7, healthy(7), [divergence, dominance])
    assert [(e.alert, e.step) for e in fired] == [("reward_up_eval_down", 7), ("reward_hacking", 7)]
    assert "divergence" in fired[0].message and "part_dominance" in fired[1].message


def test_length_correlation_is_not_an_alert_by_default():
    """It fires on the healthy default job (the format part correlates with length)."""
    event = HackingEvent("length_correlation", 5, "reward correlates with length", value=0.7, threshold=0.5)
    assert Alerts(AlertsConfig()).update(5, healthy(5), [event]) == []
    fired = Alerts(AlertsConfig(hacking_kinds=["length_correlation"])).update(5, healthy(5), [event])
    assert [(e.alert, e.step) for e in fired] == [("reward_hacking", 5)]


def test_unknown_stop_on_alert_is_named():
    with pytest.raises(ConfigError, match=r"alerts\.stop_on.*unknown alert\(s\) \['entropy'\]"):
        load_config(None, ["alerts.stop_on=[entropy]"])


def _run(tmp_path, *overrides: str, steps: int) -> tuple[Controller, Exception | None]:
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"train.steps={steps}", "rollout.prompts_per_step=8",
                             "run.eval_every=0", "run.progress=false", "run.save_every=2", *overrides])
    ctl = Controller(cfg)
    error = None
    try:
        ctl.train()
    except RunFailed as e:
        error = e
    finally:
        ctl.close()
    return ctl, error


def test_the_default_job_fires_no_alert(tmp_path):
    """25 steps of the default task (8 prompts a step, the noisiest batch the tests use): none
    of the alerts fires. tests/test_default_job.py checks the whole default job."""
    ctl, error = _run(tmp_path, steps=25)
    assert error is None and ctl.step == 25
    assert not (ctl.paths.root / "events.jsonl").exists()
    rows = [json.loads(line) for line in (ctl.paths.root / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("alerts/") for row in rows for k in row)


FLAKY_REWARD = """
import os

from tidal.rewards.arithmetic import score as arithmetic


def score(completion, answer):
    if os.path.exists({flag!r}) and len(completion) % 2:  # about half the episodes, from then on
        raise ConnectionError("the grading service went away")
    return arithmetic(completion, answer)
"""


def test_a_failure_rate_jump_alerts_and_stop_on_stops_the_run_with_its_checkpoint(tmp_path):
    """The default task's reward starts failing on about half the episodes at step 7 (as a
    grading service that goes away would): failure_rate_jump fires at step 7, and with
    alerts.stop_on=[failure_rate_jump] the run stops there (RunFailed: the CLI's exit 3),
    before the failure budget would, step 7 not checkpointed, step 6's checkpoint intact;
    the alert is in events.jsonl, metrics.jsonl and train.log."""
    flag = tmp_path / "service-down"
    reward = tmp_path / "flaky_reward.py"
    reward.write_text(FLAKY_REWARD.format(flag=str(flag)))
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "train.steps=12", "rollout.prompts_per_step=8",
                             "run.eval_every=0", "run.progress=false", "run.save_every=1",
                             f"task.reward={reward}:score", "alerts.stop_on=[failure_rate_jump]"])
    ctl = Controller(cfg)
    try:
        for _ in range(6):
            ctl.train_step()
        flag.touch()
        with pytest.raises(RunFailed, match=r"stopping at step 7 on alert failure_rate_jump \(alerts\.stop_on\): "
                                            r"the failed-episode fraction 0\.\d+ jumped over its median 0\.000"):
            ctl.train_step()
    finally:
        ctl.close()
    run = ctl.paths.root
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    # The hacking monitor's verifier_errors sees the same jump (per reward function): an alert too.
    assert [(e["alert"], e["step"]) for e in events] == [("failure_rate_jump", 7), ("reward_hacking", 7)]
    assert "verifier_errors" in events[1]["message"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 7 and rows[-1]["alerts/failure_rate_jump"] == 1.0
    assert rows[-1]["episodes/reward_error"] > 0
    assert not ctl.paths.checkpoint(7).exists() and ctl.paths.latest_checkpoint() == ctl.paths.checkpoint(6)
    assert "alert failure_rate_jump at step 7" in (run / "train.log").read_text()


def test_zero_std_frac_counts_the_groups_whose_rewards_agree():
    from tidal.monitor.step_metrics import episode_metrics
    from tidal.types import Episode, Status

    def eps(rewards_by_group):
        return [Episode(f"{g}-{i}", g, "t", "env", reward=r, status=Status.OK)
                for g, rs in rewards_by_group.items() for i, r in enumerate(rs)]

    m = episode_metrics(eps({"a": [0.0, 0.0], "b": [1.0, 0.0], "c": [0.3, 0.1 + 0.2], "d": [1.0]}))
    assert m["groups/zero_std_frac"] == pytest.approx(2 / 3)  # a, and c (equal but for the last bits); d is alone
    assert episode_metrics(eps({"a": [0.0, 0.0], "b": [0.0, 0.0]}))["groups/zero_std_frac"] == 1.0
    assert "groups/zero_std_frac" not in episode_metrics(eps({"a": [1.0], "b": [0.0]}))


def test_a_run_whose_reward_never_pays_alerts_no_learning_signal(tmp_path):
    """Every reward 0 (a reward that never pays): groups/zero_std_frac is 1 at every step and
    no_learning_signal fires once, at the step alerts.no_signal_steps is reached."""
    reward = tmp_path / "never.py"
    reward.write_text("def score(completion, answer):\n    return 0.0\n")
    ctl, error = _run(tmp_path, f"task.reward={reward}:score", "alerts.no_signal_steps=3", "reward.isolation=inline",
                      "rollout.max_new_tokens=8", steps=4)
    assert error is None
    rows = [json.loads(line) for line in (ctl.paths.root / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups/zero_std_frac"] for r in rows] == [1.0] * 4
    events = [json.loads(line) for line in (ctl.paths.root / "events.jsonl").read_text().splitlines()]
    assert [(e["alert"], e["step"]) for e in events] == [("no_learning_signal", 3)]
