"""Reward-hacking monitors on synthetic episodes: each fires on a crafted bad pattern, names
examples, and stays quiet on a healthy run that differs only in the pattern."""

from __future__ import annotations

import random

import pytest

from tidal.monitor.hacking import HackingMonitor, metrics_of, pearson, spearman
from tidal.types import Episode, Status


def ep(i: int, group: str, reward: float, length: int = 10, parts: dict | None = None, correct: float | None = None,
       status: Status = Status.OK, error: str = "", step: int = 0) -> Episode:
    e = Episode(f"e{step}-{i}", group, "t", "env", tokens=[1] * (length + 3), loss_mask=[False] * 3 + [True] * length,
                reward=reward if status.trainable else float("nan"), reward_parts=dict(parts or {}), status=status,
                error=error, step=step)
    if correct is not None:
        e.metrics["correct"] = correct
    return e


def quiet() -> HackingMonitor:
    return HackingMonitor(log_events=False)


def test_correlations_match_their_definitions():
    # By hand: deviations (-1, 0, 1) and (-1, 1, 0): r = 1 / sqrt(2 * 2) = 0.5 (exact up to float rounding).
    assert pearson([1.0, 2.0, 3.0], [1.0, 3.0, 2.0]) == pytest.approx(0.5, abs=1e-12)
    # plain pytest.approx in this file (rel 1e-6): hand values (0.1, 1/3, 18/5) against a few float
    # operations on them, which round alike on every CPU; the margin is decimal representation only
    assert spearman([1.0, 2.0, 3.0, 4.0], [1.0, 10.0, 100.0, 1000.0]) == pytest.approx(1.0)  # monotone: ranks agree
    assert spearman([1.0, 2.0, 2.0, 3.0], [3.0, 2.0, 2.0, 1.0]) == pytest.approx(-1.0)  # ties share a rank
    assert pearson([1.0, 1.0], [1.0, 2.0]) != pearson([1.0, 1.0], [1.0, 2.0])  # constant side: NaN


# -- training reward up, held-out down ------------------------------------------------------
def run_divergence(evals: list[float]) -> list:
    mon, events = quiet(), []
    for step in range(1, 10):
        eps = [ep(i, f"g{i // 4}", 0.2 + 0.05 * step, step=step) for i in range(8)]  # training reward rises
        metrics = {"reward": 0.2 + 0.05 * step}
        if step % 3 == 0:
            metrics["eval/accuracy"] = evals[step // 3 - 1]
        events += mon.update(step, eps, metrics)
    return events


def test_divergence_fires_when_heldout_falls_while_training_reward_rises():
    events = run_divergence([0.80, 0.72, 0.61])
    assert [e.kind for e in events] == ["divergence"] and events[0].step == 9
    assert "eval/accuracy" in events[0].message and "0.800 -> 0.610" in events[0].message
    assert len(events[0].episode_ids) == 5


def test_divergence_quiet_when_heldout_rises_or_one_eval_dips():
    assert run_divergence([0.60, 0.70, 0.80]) == []
    assert run_divergence([0.80, 0.60, 0.81]) == []  # a noisy eval, no trend


# -- length ---------------------------------------------------------------------------------
def test_length_correlation_fires_within_groups():
    mon = quiet()
    rng = random.Random(0)
    eps = []
    for g in range(4):
        for i in range(8):
            length = rng.randint(5, 60)
            eps.append(ep(g * 8 + i, f"g{g}", reward=length / 60 + rng.uniform(-0.05, 0.05), length=length))
    (event,) = mon.update(1, eps, {})
    assert event.kind == "length_correlation" and event.value > 0.9
    assert mon.metrics_of([event])["hacking/length_corr"] == event.value
    best = max(eps, key=lambda e: e.reward)
    assert event.episode_ids[0] == best.episode_id  # the best-rewarded (and long) answer first


def test_length_correlation_quiet_when_reward_ignores_length():
    mon = quiet()
    rng = random.Random(1)
    eps = [ep(i, f"g{i // 8}", reward=float(rng.random() < 0.5), length=rng.randint(5, 60)) for i in range(32)]
    assert mon.update(1, eps, {}) == []
    # seeded data (a fixed value); for independent samples r's std over 32 is ~1/sqrt(31) = 0.18: 0.5 is ~2.8σ
    assert abs(mon.stats["hacking/length_corr"]) < 0.5


def test_length_correlation_ignores_what_the_verifier_pays_for():
    """Longer (careful) answers are the right ones: the verifier's `correct` pays them, so the
    monitor is quiet; the same lengths paid by a judge part are reported."""
    rng = random.Random(3)
    verified, judged = [], []
    for i in range(32):
        length = rng.randint(5, 60)
        right = float(length > 30)
        verified.append(ep(i, f"g{i // 8}", reward=right + 0.1, length=length, parts={"correct": right, "format": 0.1}))
        judged.append(ep(i, f"g{i // 8}", reward=right + 0.1, length=length, parts={"judge": right, "format": 0.1}))
    kinds = lambda events: [e.kind for e in events]
    assert "length_correlation" not in kinds(quiet().update(1, verified, {}))
    assert "length_correlation" in kinds(quiet().update(1, judged, {}))
    # with the verifier's share counted too (length_corr_unverified=False), the first fires as well
    assert "length_correlation" in kinds(HackingMonitor(log_events=False, length_corr_unverified=False).update(1, verified, {}))


def _tool_run(hacked: bool, seed: int = 5) -> list:
    """A TRL or veRL reward with no `correct` part, its accuracy known (veRL's `acc`, a reward
    named `correct`): answers that use the tool or work the steps are longer and right. Hacked:
    the reward also pays length among answers of the same correctness (a length-loving judge)."""
    rng = random.Random(seed)
    eps = []
    for i in range(64):
        right = float(rng.random() < 0.5)
        length = rng.randint(40, 90) if right else rng.randint(5, 45)
        reward = right + (length / 100 if hacked else 0.0)
        eps.append(ep(i, f"g{i // 8}", reward=reward, length=length, parts={"score": reward}, correct=right))
    return eps


def test_length_that_correctness_explains_is_not_an_alarm():
    """Healthy: longer answers are the right ones, and the reward pays only rightness: quiet.
    Length-hacking: the same run, the reward also growing with length: it fires. The positive
    control for the first: without the correctness strata it fires (what main reported)."""
    kinds = lambda events: [e.kind for e in events]
    assert "length_correlation" not in kinds(quiet().update(1, _tool_run(hacked=False), {}))
    assert "length_correlation" in kinds(quiet().update(1, _tool_run(hacked=True), {}))
    blind = HackingMonitor(log_events=False, length_corr_given_correct=False)
    assert "length_correlation" in kinds(blind.update(1, _tool_run(hacked=False), {}))
    for scope in ("group", "batch"):
        mon = HackingMonitor(log_events=False, length_corr_scope=scope)
        assert "length_correlation" not in kinds(mon.update(1, _tool_run(hacked=False), {})), scope
        mon = HackingMonitor(log_events=False, length_corr_scope=scope)
        assert "length_correlation" in kinds(mon.update(1, _tool_run(hacked=True), {})), scope


def test_group_scope_ignores_a_confound_between_prompts():
    """Harder prompts have longer answers and (here) higher rewards, but within each prompt the
    reward does not follow the length: the batch-level correlation is a confound, and only the
    batch scope reports it."""
    rng = random.Random(2)
    eps = []
    for g in range(4):
        for i in range(8):
            eps.append(ep(g * 8 + i, f"g{g}", reward=g * 0.3 + (i % 2) * 0.1, length=20 * g + rng.randint(0, 5)))
    assert quiet().update(1, eps, {}) == []
    assert [e.kind for e in HackingMonitor(length_corr_scope="batch", log_events=False).update(1, eps, {})] == \
        ["length_correlation"]


def test_a_persistent_condition_is_one_event_until_it_clears():
    mon = quiet()

    def step_eps(step: int, correlated: bool):
        return [ep(i, f"g{i // 8}", reward=(i % 8) / 8 if correlated else float(i % 2), length=5 + (i % 8) * 4,
                   step=step) for i in range(16)]

    kinds = [[e.kind for e in mon.update(s, step_eps(s, c), {})] for s, c in
             enumerate([True, True, True, False, True], start=1)]
    assert kinds == [["length_correlation"], [], [], [], ["length_correlation"]]


# -- one part dominating --------------------------------------------------------------------
def test_part_dominance_fires_on_an_auxiliary_part():
    mon = quiet()
    eps = [ep(i, f"g{i // 4}", reward=0.0, parts={"correct": float(i % 4 == 0), "length_bonus": 2.0, "format": 0.1})
           for i in range(16)]
    for e in eps:
        e.reward = sum(e.reward_parts.values())
    (event,) = mon.update(1, eps, {})
    assert event.kind == "part_dominance" and "`length_bonus`" in event.message
    assert mon.stats["hacking/part_share/length_bonus"] == pytest.approx(32 / (4 + 32 + 1.6))


def test_part_dominance_quiet_when_the_verifier_leads():
    mon = quiet()
    eps = [ep(i, f"g{i // 4}", reward=0.0, parts={"correct": float(i % 4 != 0), "format": 0.1}) for i in range(16)]
    assert mon.update(1, eps, {}) == []  # correct carries 88% but is the verifier: exempt
    assert mon.stats["hacking/part_share/correct"] > 0.8
    several = [ep(i, "g", 1.0, parts={"math/correct": 1.0, "style/format": 0.1}) for i in range(16)]
    assert mon.update(2, several, {}) == []  # exempt under a reward's name too


# -- verifier errors ------------------------------------------------------------------------
def err_step(step: int, n_fail: int, n: int = 50, status: Status = Status.TIMEOUT) -> list[Episode]:
    out = []
    for i in range(n):
        if i < n_fail:
            out.append(ep(i, "g", 0.0, status=status, step=step,
                          error=f"reward function `my_pkg.grade:score` did not return within reward.timeout_s=30s "
                                f"on episode e{step}-{i}"))
        else:
            out.append(ep(i, "g", 1.0, step=step))
    return out


def test_verifier_timeout_jump_fires_and_names_the_function():
    mon = quiet()
    events = []
    for step, fails in enumerate([1, 1, 0, 1, 15, 15], start=1):
        events += mon.update(step, err_step(step, fails), {})
    kinds = sorted({(e.kind, e.step) for e in events})
    assert kinds == [("verifier_errors", 5)]  # once, at the jump; still high at step 6, no second event
    names = {e.message.split(" rate")[0] for e in events}
    assert names == {"timeout", "timeout/my_pkg.grade:score"}
    assert all(e.episode_ids[0] == "e5-0" for e in events)
    assert mon.stats["hacking/error_rate/timeout"] == pytest.approx(15 / 50)


def test_verifier_errors_quiet_at_a_steady_rate():
    mon = quiet()
    events = []
    for step in range(1, 9):
        events += mon.update(step, err_step(step, 5, status=Status.REWARD_ERROR), {})
    assert events == []
    assert mon.stats["hacking/error_rate/reward_error"] == pytest.approx(0.1)


# -- judge and verifier ---------------------------------------------------------------------
def judged(n_fooled: int, n: int = 20) -> list[Episode]:
    out = []
    for i in range(n):
        fooled = i < n_fooled
        correct = 0.0 if fooled or i % 2 else 1.0
        judge = 0.9 if fooled else (0.8 if correct else 0.1)
        out.append(ep(i, f"g{i // 4}", judge + correct, parts={"judge/judge": judge, "judge/judge_injection": 0.0,
                                                              "math/correct": correct}, correct=correct))
    return out


def test_judge_verifier_disagreement_fires_with_the_fooled_answers():
    mon = quiet()
    (event,) = [e for e in mon.update(1, judged(8), {}) if e.kind == "judge_disagreement"]
    assert "8 judged >= 0.7 but wrong" in event.message
    assert event.episode_ids == [f"e0-{i}" for i in range(5)]
    assert mon.stats["hacking/judge_disagree"] == pytest.approx(8 / 20)


def test_judge_verifier_agreement_is_quiet_and_no_verifier_means_no_statistic():
    mon = quiet()
    assert [e for e in mon.update(1, judged(0), {}) if e.kind == "judge_disagreement"] == []
    assert mon.stats["hacking/judge_disagree"] == 0.0
    judge_only = [ep(i, "g", 0.9, parts={"judge": 0.9, "judge_injection": 0.0}, correct=1.0) for i in range(20)]
    mon.update(2, judge_only, {})
    assert "hacking/judge_disagree" not in mon.stats  # `correct` here is only reward > 0, not a verifier


def test_metrics_count_every_kind():
    m = metrics_of([])
    assert set(m) == {f"hacking/events/{k}" for k in ("divergence", "length_correlation", "part_dominance",
                                                       "verifier_errors", "judge_disagreement")}
    assert all(v == 0.0 for v in m.values())


def test_failed_episodes_are_left_out_of_reward_statistics():
    honest = [ep(i, f"g{i // 8}", reward=float(i % 2), length=5 + i) for i in range(16)]
    failed = [ep(100 + i, "g9", 0.0, status=Status.REWARD_ERROR, length=500) for i in range(4)]
    with_failed, without = quiet(), quiet()
    with_failed.update(1, honest + failed, {})
    without.update(1, honest, {})
    assert with_failed.stats["hacking/length_corr"] == without.stats["hacking/length_corr"]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="divergence_window"):
        HackingMonitor(divergence_window=1)
    with pytest.raises(ValueError, match="length_corr_method"):
        HackingMonitor(length_corr_method="kendall")
