"""docs/agents.md's own-environment example: the page shows the file as it is (under 60 lines),
a scripted policy sees the observations it should, and `tidal train` trains it with per-turn
rewards kept in the episode store."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pyarrow.parquet as pq

from tidal.config import load_config
from tidal.runtime.controller import Controller
from tidal.runtime.rollout import Rollout, group_specs
from tidal.runtime.tasks import build_task
from tidal.types import GenerationResult, SamplingParams, Status

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "envs" / "guess.py"


def test_docs_show_the_example_file_as_it_is():
    page = (ROOT / "docs" / "agents.md").read_text()
    block = re.search(r"<!-- guess.py -->\n```python\n(.*?)```\n<!-- /guess.py -->", page, re.DOTALL)
    assert block is not None and block.group(1) == EXAMPLE.read_text()
    assert len(EXAMPLE.read_text().splitlines()) < 60


class Guesser:
    """A scripted policy that guesses 50, then 25, then writes no answer, then the secret."""

    def __init__(self, tok, secret):
        self.tok, self.texts = tok, ["<answer>50</answer>", "<answer>25</answer>", "hmm", f"<answer>{secret}</answer>"]
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, requests):
        out = []
        for r in requests:
            ids = self.tok(self.texts[int(r.request_id.rsplit("/", 1)[1])], add_special_tokens=False)["input_ids"]
            out.append(GenerationResult(r.request_id, ids + [self.end], [-1.0] * (len(ids) + 1), "stop", 0))
        return out


def test_scripted_policy_gets_hints_and_per_turn_rewards(tokenizer):
    cfg = load_config(overrides=[f"task.env={EXAMPLE}:GuessEnv", "task.train_size=4", "task.eval_size=2"])
    task = build_task(cfg.task)
    row = {**task.train_rows[0], "secret": 10}
    rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=50), max_turns=4)
    ep = asyncio.run(rollout.run(group_specs([row], task.make_env, 1, 0, 1), Guesser(tokenizer, 10), 1))[0]
    assert ep.status is Status.OK and [t.reward for t in ep.turns] == [-0.1, -0.1, -0.1, 1.0]
    text = tokenizer.decode(ep.tokens)
    assert text.count("No, lower.") == 2 and "Answer <answer>N</answer>.<|im_end|>" in text.split("hmm")[1]
    assert ep.reward_parts == {"penalty": -0.30000000000000004, "correct": 1.0} and ep.metrics["correct"] == 1.0


def test_tidal_train_runs_the_example_and_stores_turns(tiny_model_dir, tmp_path):
    cfg = load_config(overrides=[
        f"task.env={EXAMPLE}:GuessEnv", "rollout.max_turns=3", "rollout.max_new_tokens=8", f"model.path={tiny_model_dir}",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "train.steps=1", "task.train_size=8",
        "task.eval_size=4", "eval.n=4", "run.eval_every=1", f"run.dir={tmp_path / 'run'}", "run.progress=false"])
    ctl = Controller(cfg)
    try:
        m = ctl.train()
    finally:
        ctl.close()
    assert m["episodes"] == 4 and "eval/accuracy" in m and m["turns"] >= 1
    rows = pq.read_table(tmp_path / "run" / "episodes" / "step_000001.parquet").to_pylist()
    assert {r["env"] for r in rows} == {"guess"}
    for r in rows:
        assert r["status"] in ("ok", "truncated") and len(r["turns"]) >= 1
        # the tiny model writes no <answer> tag: every turn pays the penalty, and the store says so
        assert [t["reward"] for t in r["turns"]] == [-0.1] * len(r["turns"]) or r["turns"][-1]["reward"] == 1.0


def test_docs_show_the_openai_agent_as_it_is():
    page = (ROOT / "docs" / "agents.md").read_text()
    block = re.search(r"<!-- react_calculator.py -->\n```python\n(.*?)```\n<!-- /react_calculator.py -->", page,
                      re.DOTALL)
    agent = ROOT / "examples" / "agents" / "react_calculator.py"
    assert block is not None and block.group(1) == agent.read_text()
    assert "tidal" not in agent.read_text().split('"""', 2)[2]  # the agent's code imports nothing of tidal
