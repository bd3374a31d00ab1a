"""`run.log_samples`: a table of some of a step's episodes, as the model saw them."""

from __future__ import annotations

import random
from typing import Any

from tidal.types import Episode

COLUMNS = ["step", "episode", "status", "reward", "prompt", "response", "error"]


def sample_table(step: int, episodes: list[Episode], n: int, tokenizer: Any) -> tuple[list[str], list[list[Any]]]:
    """`n` of the step's episodes, chosen by a generator seeded with the step (the same run
    shows the same ones), in episode order; prompt and response decoded with special tokens,
    so tool calls and observations show as the model saw them."""
    chosen = sorted(random.Random(step).sample(range(len(episodes)), min(n, len(episodes))))
    rows = []
    for i in chosen:
        e = episodes[i]
        rows.append([step, e.episode_id, e.status.value, round(float(e.reward), 4),
                     tokenizer.decode(e.tokens[: e.prompt_len]), tokenizer.decode(e.tokens[e.prompt_len:]), e.error])
    return COLUMNS, rows
