"""A run directory of synthetic episodes, to try the dashboard on and to measure it at any
size (benchmarks/dashboard.py makes one of a million episodes).

The episodes are real `Episode` records of the default task's shape (a chat-templated "What
is a + b?" prompt, an `<answer>` reply, a tool call on some), tokenized with the default
model's tokenizer and written by the store's own writer, text decoded; the run has a
metrics.jsonl row per step with the default job's keys, a config.yaml and a few alert events.
What is synthetic is only who chose the tokens: a seeded random generator, not a model.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from tidal.config import dump_config, load_config
from tidal.models import load_tokenizer
from tidal.monitor.episodes import EpisodeWriter
from tidal.types import Episode, Status, ToolCallRecord, Turn


def _episode(rng: random.Random, step: int, i: int, group_size: int, skill: float, prompt, reply) -> Episode:
    """Episode `i` of `step`: a subtraction answered right with probability 0.3 + 0.65 * skill,
    one in ten through the `sub` tool, about one in a hundred failed and two truncated."""
    g, e = divmod(i, group_size)
    a, b = rng.randrange(100), rng.randrange(100)
    correct = rng.random() < 0.3 + 0.65 * skill
    answer = a - b if correct else a - b + rng.choice([-10, -1, 1, 2, 10])
    tool = rng.random() < 0.1
    p = prompt(a, b)
    r = reply(f"<tool_call>sub({a}, {b})</tool_call>" if tool else f"<answer>{answer}</answer>")
    status, error = Status.OK, ""
    if rng.random() < 0.01:
        status = Status.REWARD_ERROR
        error = "reward function `tidal.rewards.arithmetic:score` raised ValueError('unparsable answer')"
    elif rng.random() < 0.02:
        status = Status.TRUNCATED
    reward = (1.0 if correct else 0.0) + 0.1 if status is Status.OK else 0.0
    lp = [-abs(rng.gauss(0, 0.3 if correct else 1.0)) for _ in r]
    calls = [ToolCallRecord("sub", json.dumps({"a": a, "b": b}), f"call-{i}", "ok", "", 3, 1e-4)] \
        if tool else []
    n = len(p) + len(r)
    return Episode(
        episode_id=f"s{step}-p{g}-e{e}", group_id=f"s{step}-p{g}", task_id=f"arith-{a}-{b}",
        env="tool_arith" if tool else "arithmetic", tokens=p + r,
        loss_mask=[False] * len(p) + [True] * len(r), logprobs=[0.0] * len(p) + lp,
        versions=[-1] * len(p) + [step - 1] * len(r), reward=reward,
        reward_parts={"correct": float(correct), "format": 0.1} if status is Status.OK else {},
        status=status, error=error, metrics={"response_tokens": float(len(r))}, prompt_len=len(p),
        step=step, seed=rng.getrandbits(63), outcome_reward=reward,
        turns=[Turn(0, len(p), n, n, "", "stop", 0.0, calls, step - 1)])


def make_run(root: str | Path, *, episodes: int, steps: int, group_size: int = 8, seed: int = 0,
             progress: bool = False) -> Path:
    if episodes < steps or steps < 1:
        raise ValueError(f"make_run: need at least one episode per step ({episodes} episodes, {steps} steps)")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer("default")
    cfg = load_config(None, [f"run.dir={root}", f"train.steps={steps}"])
    (root / "config.yaml").write_text(dump_config(cfg))
    rng = random.Random(seed)
    prompts: dict[tuple[int, int], list[int]] = {}
    answers: dict[str, list[int]] = {}

    def prompt(a: int, b: int) -> list[int]:
        if (a, b) not in prompts:
            prompts[(a, b)] = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"What is {a} - {b}?"}], add_generation_prompt=True, tokenize=True,
                return_dict=False)
        return prompts[(a, b)]

    def reply(text: str) -> list[int]:
        if text not in answers:
            answers[text] = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
        return answers[text]

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=episodes, unit="ep", desc=f"making {root.name}")
    per_step = [episodes // steps + (1 if s < episodes % steps else 0) for s in range(steps)]
    with EpisodeWriter(root / "episodes", tokenizer) as writer, (root / "metrics.jsonl").open("w") as metrics, \
            (root / "events.jsonl").open("w") as events:
        elapsed = 0.0
        for step in range(1, steps + 1):
            skill = 1 - math.exp(-step / max(1.0, steps / 5))  # accuracy rises over the run
            rewards, lengths, failed = [], [], 0
            for i in range(per_step[step - 1]):
                episode = _episode(rng, step, i, group_size, skill, prompt, reply)
                writer.add(episode)
                reward, status = episode.reward, episode.status
                rewards.append(reward)
                lengths.append(len(episode.tokens) - episode.prompt_len)
                failed += status is Status.REWARD_ERROR
                if bar is not None:
                    bar.update(1)
            writer.end_step(step)
            step_s = 0.4 + rng.random() * 0.1
            elapsed += step_s
            n = len(rewards)
            metrics.write(json.dumps({
                "step": step, "reward": sum(rewards) / n, "accuracy": sum(x > 0.5 for x in rewards) / n,
                "response_tokens": sum(lengths) / n, "entropy": 0.05 * (1 - 0.5 * skill) + rng.random() * 0.005,
                "kl": 0.001 * step / steps + rng.random() * 1e-4, "grad_norm": 0.3 + rng.random() * 0.1,
                "episodes": float(n), "episodes/failed_frac": failed / n, "time/step_s": step_s,
                "time/elapsed_s": elapsed, "version": step}) + "\n")
            if step % max(1, steps // 4) == 0:
                events.write(json.dumps({"kind": "alert", "alert": "kl_spike", "step": step, "value": 0.01,
                                         "threshold": 0.005, "message": f"kl at step {step} is 10x its median",
                                         "time": ""}) + "\n")
    if bar is not None:
        bar.close()
    return root
