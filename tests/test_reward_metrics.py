"""What a reward reports besides its value reaches the step's metrics, and accuracy is read
where the reward says what is correct: veRL's `acc`, a reward named `correct` (any form).
Real adapters through the inline scorer, then the step's metrics (tidal/monitor/step_metrics.py)."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from tidal.config import RewardConfig, RewardSpec
from tidal.monitor.step_metrics import episode_metrics
from tidal.rewards.contract import RewardInput
from tidal.rewards.pool import build_scorer
from tidal.types import Episode, Status

REWARDS = textwrap.dedent('''
    from tidal.rewards.contract import RewardParts

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        ok = solution_str.strip() == ground_truth
        return {"score": 2.0 * ok - 0.5, "acc": float(ok), "pred": solution_str, "n_chars": len(solution_str)}

    def trl_match(prompts, completions, answer, **kw):
        return [float(c == a) for c, a in zip(completions, answer)]

    def with_metrics(completion, answer):
        return RewardParts({"hit": float(completion == answer)}, {"tries": 3.0, "judge/cached": 1.0})
''')


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "extras.py"
    path.write_text(REWARDS)
    return str(path)


def inp(i: int, completion: str, answer: str) -> RewardInput:
    pm = [{"role": "user", "content": "what?"}]
    cols = {"answer": answer, "data_source": "d", "reward_model": {"ground_truth": answer}}
    return RewardInput(f"e{i}", "g0", "t0", 1, "what?", pm, completion, [1, 2], [*pm], [], cols)


def score(specs, inputs):
    scorer = build_scorer(specs, RewardConfig(isolation="inline"))
    try:
        return asyncio.run(scorer.score(inputs))
    finally:
        asyncio.run(scorer.close())


def step_of(outcomes) -> dict[str, float]:
    eps = []
    for i, o in enumerate(outcomes):
        e = Episode(f"e{i}", "g0", "t0", "env", status=Status.OK)
        e.reward, e.reward_parts = o.reward, dict(o.parts)
        e.metrics.update(o.metrics)
        eps.append(e)
    return episode_metrics(eps)


def test_verl_extras_reach_the_step_metrics_and_acc_is_accuracy(rewards_file):
    outs = score([RewardSpec(fn=f"{rewards_file}:compute_score", form="verl")],
                 [inp(0, "4", "4"), inp(1, "5", "4"), inp(2, "12", "4")])
    m = step_of(outs)
    assert m["reward/extra/acc"] == pytest.approx(1 / 3)
    assert m["reward/extra/n_chars"] == pytest.approx(4 / 3)
    assert m["accuracy"] == pytest.approx(1 / 3)  # from `acc`: the score (-0.5 when wrong) says nothing of it
    assert not any("pred" in k for k in m)  # a string is not a metric


def test_a_reward_named_correct_is_accuracy_in_any_form(rewards_file):
    outs = score([RewardSpec(fn=f"{rewards_file}:trl_match", form="trl", name="correct", weight=0.5)],
                 [inp(0, "4", "4"), inp(1, "5", "4")])
    assert [o.metrics.get("correct") for o in outs] == [1.0, 0.0]  # unweighted, though its part is 0.5
    unnamed = score([RewardSpec(fn=f"{rewards_file}:trl_match", form="trl")], [inp(0, "4", "4")])
    assert "correct" not in unnamed[0].metrics  # a TRL float says nothing of correctness by itself


def test_reward_parts_metrics_reach_the_step_metrics_among_several(rewards_file):
    outs = score([RewardSpec(fn=f"{rewards_file}:with_metrics", name="w"),
                  RewardSpec(fn=f"{rewards_file}:compute_score", form="verl", name="v")], [inp(0, "4", "4")])
    m = step_of(outs)
    assert m["reward/extra/w/tries"] == 3.0 and m["reward/extra/v/acc"] == 1.0
    assert m["judge/cached"] == 1.0  # a key with a `/` is a metric name already
    assert m["accuracy"] == 1.0
