"""Prompt datasets, the generated arithmetic task, and reward functions."""

import json
import math
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidal.envs.arithmetic import ArithmeticConfig, make_problems
from tidal.envs.dataset import DatasetError, PromptSource, load_prompts
from tidal.rewards import call_reward, load_reward_fn
from tidal.rewards.arithmetic import score

ROWS = [
    {"prompt": "What is 1 + 2?", "answer": "3"},
    {"prompt": [{"role": "user", "content": "What is 2 * 5?"}], "answer": "10"},
    {"prompt": "What is 7 - 9?", "answer": "-2"},
]

# ---------------------------------------------------------------- load_prompts


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_prompts(path) == ROWS


def test_load_parquet(tmp_path):
    rows = [{"prompt": "What is 1 + 2?", "answer": "3"}, {"prompt": "What is 4 + 4?", "answer": "8"}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_prompts(path) == rows


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "absent.jsonl"
    with pytest.raises(DatasetError, match="absent.jsonl"):
        load_prompts(path)


def test_row_without_prompt_names_row_and_columns(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"question": "What is 1 + 1?", "answer": "2"}])
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    msg = str(e.value)
    assert "row 1" in msg  # rows are numbered from 0
    assert "prompt" in msg
    assert "answer, question" in msg


def test_bad_json_names_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + '{"prompt": "x", \n')
    with pytest.raises(DatasetError, match="line 2"):
        load_prompts(path)


# ---------------------------------------------------------------- PromptSource

ID_ROWS = [{"prompt": f"p{i}", "id": i} for i in range(10)]


def _ids(rows):
    return [r["id"] for r in rows]


def test_prompt_source_deterministic_per_seed():
    assert _ids(PromptSource(ID_ROWS, seed=3).take(25)) == _ids(PromptSource(ID_ROWS, seed=3).take(25))
    assert _ids(PromptSource(ID_ROWS, seed=3).take(25)) != _ids(PromptSource(ID_ROWS, seed=4).take(25))


def test_prompt_source_covers_every_row_once_per_epoch():
    src = PromptSource(ID_ROWS, seed=0)
    epochs = [_ids(src.take(10)) for _ in range(3)]
    for ids in epochs:
        assert sorted(ids) == list(range(10))
    assert epochs[0] != epochs[1]  # a fresh permutation each epoch


def test_prompt_source_resumes_identically():
    a = PromptSource(ID_ROWS, seed=7)
    a.take(13)  # mid second epoch
    state = a.state_dict()
    b = PromptSource(ID_ROWS, seed=7)
    b.load_state_dict(state)
    assert _ids(b.take(22)) == _ids(a.take(22))


# ---------------------------------------------------------------- make_problems

QUESTION_RE = re.compile(r"What is (-?\d+) ([+\-*]) (-?\d+)\?")
ALL_OPS = ArithmeticConfig(ops="+-*")


def _text(row):
    return row["prompt"][0]["content"]


def test_train_and_test_are_disjoint():
    train = {_text(r) for seed in (0, 1) for r in make_problems(ALL_OPS, "train", 400, seed)}
    test = {_text(r) for seed in (0, 1) for r in make_problems(ALL_OPS, "test", 100, seed)}
    assert len(test) > 100  # two seeds drew different problems
    assert not train & test


def test_problems_are_deterministic_per_seed():
    assert make_problems(ALL_OPS, "train", 50, 5) == make_problems(ALL_OPS, "train", 50, 5)
    assert make_problems(ALL_OPS, "train", 50, 5) != make_problems(ALL_OPS, "train", 50, 6)


def test_problem_answers_are_correct():
    rows = make_problems(ALL_OPS, "train", 200, 0) + make_problems(ALL_OPS, "test", 50, 0)
    assert len({_text(r) for r in rows}) == len(rows)
    ops = set()
    for r in rows:
        a, op, b = QUESTION_RE.fullmatch(_text(r)).groups()
        a, b = int(a), int(b)
        ops.add(op)
        assert int(r["answer"]) == {"+": a + b, "-": a - b, "*": a * b}[op]
    assert ops == {"+", "-", "*"}


# ---------------------------------------------------------------- arithmetic reward


@pytest.mark.parametrize(
    "completion, correct, fmt",
    [
        ("<answer>12</answer>", 1.0, 0.1),
        ("<answer>13</answer>", 0.0, 0.1),
        ("12", 0.0, 0.0),
        ("<answer>12</answer> extra", 1.0, 0.0),
    ],
)
def test_arithmetic_score(completion, correct, fmt):
    out = score(completion, answer="12")
    assert out["correct"] == correct
    # plain pytest.approx in this file (rel 1e-6): hand values (0.1, 1/3, 18/5) against a few float
    # operations on them, which round alike on every CPU; the margin is decimal representation only
    assert out["format"] == pytest.approx(fmt)


# ---------------------------------------------------------------- reward loading and calling


def test_load_reward_fn_by_dotted_path():
    fn = load_reward_fn("tidal.rewards.arithmetic:score")
    assert fn is score
    total, parts = call_reward(fn, "<answer>12</answer>", {"answer": "12", "task_id": "t"})
    assert parts == {"correct": 1.0, "format": pytest.approx(0.1)}
    assert total == pytest.approx(1.1)


@pytest.mark.parametrize(
    "path, named",
    [
        ("nope.mod:f", "nope.mod"),
        ("tidal.rewards.arithmetic:nope", "no attribute `nope`"),
        ("notadottedpath", "notadottedpath"),
    ],
)
def test_bad_reward_paths_name_what_failed(path, named):
    with pytest.raises(ValueError) as e:
        load_reward_fn(path)
    assert named in str(e.value)


def test_call_reward_passes_only_accepted_columns():
    seen = {}

    def strict(completion, answer):
        seen["answer"] = answer
        return 0.5

    assert call_reward(strict, "c", {"answer": "3", "task_id": "t", "extra": 1}) == (0.5, {})
    assert seen == {"answer": "3"}


def test_call_reward_passes_everything_to_var_kwargs():
    seen = {}

    def loose(completion, **kwargs):
        seen.update(kwargs)
        return {"a": 1, "b": 0.25}

    columns = {"answer": "3", "task_id": "t", "extra": 1}
    assert call_reward(loose, "c", columns) == (1.25, {"a": 1.0, "b": 0.25})
    assert seen == columns


@pytest.mark.parametrize("out", [math.nan, math.inf, {"correct": 1.0, "bonus": -math.inf}])
def test_non_finite_reward_raises(out):
    with pytest.raises(ValueError, match="non-finite"):
        call_reward(lambda completion: out, "c", {"answer": "1"})
