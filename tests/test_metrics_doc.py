"""docs/metrics.md names every key a run writes to metrics.jsonl: the default job, PPO with a
critic and a KL reference, DAPO's dynamic sampling, off-policy corrections and an agent run's
tool metrics (a key that appears in a run and not on the page fails)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tidal.config import load_config
from tidal.runtime.controller import Controller

ROOT = Path(__file__).resolve().parents[1]


def documented() -> list[re.Pattern]:
    """The page's keys (first column of its tables), `<placeholder>` matching one path part."""
    keys = []
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("| `"):
            for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
                if name.startswith("<"):  # the catch-all row for envs' own metrics: would match anything
                    continue
                keys.append(re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(name).replace(r"\<", "<").replace(r"\>", ">"))
                                       + r"\Z"))
    return keys


SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "task.train_size=32",
         "task.eval_size=8", "run.progress=false", "run.eval_every=1", "eval.n=4", "train.steps=1", "run.save_every=0",
         "reward.isolation=inline"]


@pytest.mark.parametrize("extra", [[], ["algorithm.advantage=gae", "algorithm.kl_coef=0.1"],
                                   ["algorithm.dynamic_sampling=true", "algorithm.overlong_buffer=2"],
                                   ["algorithm.is_level=token", "algorithm.rejection=token"],
                                   [f"model.path={ROOT / 'tidal/models/assets/tiny-tool'}", "task.env=tool_arith",
                                    "rollout.max_turns=3", "rollout.max_new_tokens=40"]],
                         ids=["default", "ppo+kl", "dapo", "corrections", "tools"])
def test_every_metric_a_run_logs_is_documented(tiny_model_dir, tmp_path, extra):
    ctl = Controller(load_config(None, [f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", *SMALL, *extra]))
    try:
        ctl.train()
    finally:
        ctl.close()
    keys = {k for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    patterns = documented()
    missing = sorted(k for k in keys if not any(p.match(k) for p in patterns))
    assert not missing, f"docs/metrics.md does not name {missing}"
    assert len(keys) > 30  # a real run's metrics were read
    if "task.env=tool_arith" in extra:
        assert "tools/calls" in keys and "tools/errors/parse" in keys


def test_the_page_check_can_fail():
    patterns = documented()
    assert any(p.match("reward/correct") for p in patterns) and any(p.match("episodes/ok") for p in patterns)
    assert not any(p.match("no_such_metric") for p in patterns)
    assert not any(p.match("reward/a/b") for p in patterns)  # a placeholder is one path part
    assert not any(p.match("hacking/made_up") for p in patterns)  # the catch-all row is not a pass
