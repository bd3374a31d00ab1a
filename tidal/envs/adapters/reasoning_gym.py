"""reasoning-gym tasks as tidal datasets: `task.dataset: reasoning_gym:TASK`.

A reasoning-gym task is a procedural dataset (`reasoning_gym.create_dataset(TASK, size=, seed=,
**config)`) whose entries carry a question, an answer and metadata, and whose own `score_answer`
grades an answer. The rows here are its entries: the question as the user's message, the
dataset's coordinates (task, seed, size, config, index) as columns. The reward (`score`) rebuilds
the entry from those coordinates in the reward worker (an entry is generated from seed + index,
so this is cheap and exact: metadata never crosses a JSON round trip) and calls the task's
`score_answer` on the extracted answer.

The extraction: the text inside the completion's last `<answer>...</answer>` (reasoning-gym's
own `extract_answer`, the form its default system prompt asks for); a completion without one is
scored on None (0: the task's own rule). `score_answer` wants the extracted answer: given the raw
`<answer>7</answer>` it scores 0.15, not 1.

Train and held-out rows come from distinct seeds (`task.seed` and `task.seed + EVAL_SEED_OFFSET`);
reasoning-gym draws each entry from its own seed, so the two splits are independent draws of the
same distribution (a short task's problem space may still hold the same question in both).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

PREFIX = "reasoning_gym:"
EVAL_SEED_OFFSET = 1_000_003  # far from any train seed a user would also pick


def task_name(dataset: str) -> str:
    return dataset.removeprefix(PREFIX)


def _create(task: str, size: int, seed: int, config: dict[str, Any]):
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"`task.dataset`: reasoning-gym has no task `{task}` "
                         f"(it has {len(DATASETS)}: {', '.join(sorted(DATASETS))})")
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as e:  # its configs validate by assert
        raise ValueError(f"`task.dataset_args`: reasoning-gym task `{task}` rejects {config}: {e}") from None


def _message(entry: dict[str, Any], template: str | None, task: str) -> str:
    if template is None:
        return entry["question"]
    fields = {**entry["metadata"], "question": entry["question"]}
    try:
        return template.format(**fields)
    except (KeyError, IndexError) as e:
        raise ValueError(f"`task.prompt_template`: {e} is not a field of a `{task}` entry "
                         f"(fields: {', '.join(sorted(fields))})") from None


def rows(dataset: str, split: str, size: int, seed: int, config: dict[str, Any],
         template: str | None = None) -> list[dict[str, Any]]:
    """`size` rows of the task named by `dataset` (`reasoning_gym:TASK`) for `split` ("train"
    or "test"), each a user message (the question, or `template` formatted with the entry's
    question and metadata) and the coordinates `score` rebuilds the entry from."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    task = task_name(dataset)
    split_seed = seed if split == "train" else seed + EVAL_SEED_OFFSET
    data = _create(task, size, split_seed, config)
    cfg = json.dumps(config, sort_keys=True)
    return [{"prompt": [{"role": "user", "content": _message(entry, template, task)}],
             "answer": str(entry["answer"]),
             "task_id": f"rg-{task}-{split_seed}-{i}",
             "rg_task": task, "rg_seed": split_seed, "rg_size": size, "rg_index": i, "rg_config": cfg}
            for i, entry in enumerate(data)]


@lru_cache(maxsize=32)
def _dataset(task: str, size: int, seed: int, config: str):
    return _create(task, size, seed, json.loads(config))


def extract(completion: str) -> str | None:
    """The answer the policy gave: reasoning-gym's own extraction (the last `<answer>` tag)."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion, tag_name="answer")


def score(completion: str, rg_task: str, rg_seed: int, rg_size: int, rg_index: int, rg_config: str,
          **_: Any) -> dict[str, float]:
    """The task's `score_answer` on the extracted answer, as the part `correct` (in [0, 1]; some
    tasks give partial credit, which then counts as that fraction of a correct answer)."""
    import reasoning_gym

    entry = _dataset(rg_task, int(rg_size), int(rg_seed), rg_config)[int(rg_index)]
    value = reasoning_gym.get_score_answer_fn(rg_task)(extract(completion), entry)
    return {"correct": float(value)}
