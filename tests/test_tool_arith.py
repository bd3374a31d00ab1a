"""tool_arith: the safe calculator, splits from a seed that never overlap, the verifier, the env's
determinism, and the shipped tiny tool model's chat template (prefix-preserving with tools)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import pytest

from tidal.envs.base import Action
from tidal.envs.tool_arith import KINDS, MAX_EXPRESSION_CHARS, ToolArithEnv, calculator, evaluate, make_rows, score
from tidal.models import TOOL_MODEL_DIR


@pytest.mark.parametrize("expr, value", [
    ("(347 * 28) - 1592", "8124"), ("4321 * 987", "4264827"), ("-3 + +4", "1"), ("7 / 2", "3.5"),
    ("(1 + 2) * (3 - 10)", "-21"), ("10 / 4 * 2", "5"),
])
def test_calculator_values(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize("expr, words", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("2 ** 10", "BinOp is not allowed"),
    ("1.5 * 2", "the literal 1.5 is not allowed"),
    ("'a' * 3", "the literal 'a' is not allowed"),
    ("True + 1", "the literal True is not allowed"),
    ("1 / 0", "division by zero"),
    ("1 +", "not an arithmetic expression"),
    ("9" * 31, "exceeds"),
    ("1+" * 150 + "1", f"longer than {MAX_EXPRESSION_CHARS}"),
])
def test_calculator_refuses(expr, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("*", r"\*")):
        evaluate(expr)


def test_rows_deterministic_disjoint_and_hard():
    train, test = make_rows("train", 400, seed=7), make_rows("test", 200, seed=7)
    assert train == make_rows("train", 400, seed=7) and train != make_rows("train", 400, seed=8)
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in make_rows("test", 300, seed=8)}
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    assert {r["kind"] for r in train} == set(KINDS)
    for r in train + test:
        assert r["prompt"][0]["content"] == f"What is {r['expression']}?"
        assert calculator(r["expression"]) == r["answer"]
        # every problem multiplies a number of 3+ digits by one of 2+ digits
        a, b = re.search(r"(\d+)\)? \* \(?(\d+)", r["expression"]).groups()
        assert len(a) >= 3 and len(b) >= 2
    with pytest.raises(ValueError, match="unknown problem kind 'pow'"):
        make_rows("train", 5, seed=0, kinds=("pow",))
    with pytest.raises(ValueError, match="split must be"):
        ToolArithEnv.rows("dev", 5, seed=0)
    assert ToolArithEnv.rows("test", 50, seed=1, kinds=["mul"]) == make_rows("test", 50, 1, ("mul",))


def test_score_reads_the_final_answer():
    assert score("<answer>8124</answer>", "8124") == {"correct": 1.0, "format": 0.1}
    assert score("I think <answer>1</answer> no, <answer>8124</answer>", 8124) == {"correct": 1.0, "format": 0.0}
    assert score("<answer>8124</answer> <answer>1</answer>", "8124")["correct"] == 0.0
    assert score('<tool_call>{"name": "calculator"}</tool_call>', "8124") == {"correct": 0.0, "format": 0.0}
    assert score("8124", "8124") == {"correct": 0.0, "format": 0.0}


def _episode(env: ToolArithEnv, actions: list[str]):
    async def run():
        obs = [await env.reset()]
        for i, a in enumerate(actions):
            out = await env.step(Action(a, turn=i))
            obs.append((out.messages, out.done, out.metrics, out.assistant_message,
                        [dataclasses.replace(r, duration_s=0.0) for r in out.tool_calls]))
            if out.done:
                break
        await env.close()
        return obs
    return asyncio.run(run())


def test_env_same_seed_same_actions_same_observations():
    row = make_rows("test", 1, seed=3)[0]
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{row["expression"]}"}}}}</tool_call>'
    actions = ['<tool_call>{"name": "calc", "arguments": {}}</tool_call>', call + call, f"<answer>{row['answer']}</answer>"]
    first = _episode(ToolArithEnv(row, seed=11), actions)
    assert first == _episode(ToolArithEnv(row, seed=11), actions)
    assert first[0][0] == {"role": "system", "content": "Solve the problem. End with <answer>N</answer>."}
    unknown, parallel, final = first[1], first[2], first[3]
    assert unknown[0][0]["content"].startswith("error: unknown tool `calc`") and not unknown[1]
    assert [m["content"] for m in parallel[0]] == [row["answer"]] * 2
    assert [m["tool_call_id"] for m in parallel[0]] == ["call_1_0", "call_1_1"]
    assert parallel[2]["tools/calls"] == 2.0 and final[1] and final[0] == []
    assert score(actions[-1], row["answer"])["correct"] == 1.0


def test_env_calculator_error_is_an_observation():
    row = make_rows("train", 1, seed=0)[0]
    out = _episode(ToolArithEnv(row, seed=0, max_tool_output_chars=40),
                   ['<tool_call>{"name": "calculator", "arguments": {"expression": "2 ** 999"}}</tool_call>'])
    msg, rec = out[1][0][0], out[1][4][0]
    assert rec.status == "raised" and msg["content"].startswith("error: `calculator` raised ValueError")
    assert "truncated" in msg["content"] and out[1][2]["tools/errors/raised"] == 1.0


def test_shipped_template_renders_tools_and_is_prefix_preserving():
    """The policy's turns, as the template renders them back in the history (with `tool_calls`
    and tool results), extend the conversation so far: no prefix break on the happy path."""
    from tidal.models import load_tokenizer

    tok = load_tokenizer(TOOL_MODEL_DIR)
    row = make_rows("test", 1, seed=5)[0]
    env = ToolArithEnv(row, seed=0)
    call = json.dumps({"name": "calculator", "arguments": {"expression": row["expression"]}})
    turns = [f"<tool_call>{call}</tool_call>",
             f"<tool_call>{call}</tool_call>\n<tool_call>{call}</tool_call>",  # two parallel calls
             f"<answer>{row['answer']}</answer>"]

    async def run():
        history = await env.reset()
        rendered = tok.apply_chat_template(history, tools=env.tools, add_generation_prompt=True, tokenize=False)
        assert '"name": "calculator"' in rendered and "Solve the problem." in rendered
        for i, text in enumerate(turns):
            out = await env.step(Action(text, turn=i))
            if out.done:
                return rendered
            rendered += text + "<|im_end|>"
            history = [*history, out.assistant_message, *out.messages]
            after = tok.apply_chat_template(history, tools=env.tools, add_generation_prompt=True, tokenize=False)
            assert after.startswith(rendered), (rendered, after)
            rendered = after
        return rendered

    text = asyncio.run(run())
    assert text.count(f"<tool_response>{row['answer']}</tool_response>") == 3
    # the tags are text, kept when the rollout decodes with skip_special_tokens=True
    ids = tok(turns[0], add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == turns[0]


def test_tidal_train_two_steps_with_the_tiny_tool_model(tmp_path):
    """`tidal train examples/tool_arith.yaml` end to end for 2 steps (torch engine, tiny-tool):
    the model calls the calculator, results come back as masked observation tokens, the turns
    and their tool calls reach the Parquet store, the tool metrics reach metrics.jsonl."""
    import pyarrow.parquet as pq

    from tidal.config import load_config
    from tidal.models import load_tokenizer
    from tidal.runtime.controller import Controller

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / "tool_arith.yaml", [
        f"model.path={TOOL_MODEL_DIR}", "train.steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=8",
        "task.train_size=16", "task.eval_size=4", "eval.n=4", "run.eval_every=0", "reward.isolation=inline",
        f"run.dir={tmp_path / 'run'}", "run.progress=false"])
    ctl = Controller(cfg)
    try:
        m = ctl.train()
    finally:
        ctl.close()
    assert m["episodes"] == 16 and all(f"tools/errors/{k}" in m for k in ("parse", "unknown", "args", "timeout", "raised"))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "tools/calls" in r] == [1, 2]
    tok = load_tokenizer(TOOL_MODEL_DIR)
    rows = [r for s in (1, 2) for r in pq.read_table(tmp_path / "run" / "episodes" / f"step_{s:06d}.parquet").to_pylist()]
    called = 0
    for r in rows:
        assert r["env"] == "tool_arith" and r["status"] in ("ok", "truncated")
        for t in r["turns"]:
            assert all(r["loss_mask"][t["start"]:t["end"]]) and not any(r["loss_mask"][t["end"]:t["obs_end"]])
            assert tok.decode(r["tokens"][t["start"]:t["end"]], skip_special_tokens=True) == t["text"]
            for c in t["tool_calls"]:
                if c["status"] != "ok" or c["name"] != "calculator":
                    continue
                called += 1
                result = calculator(json.loads(c["arguments"])["expression"])
                assert f"<tool_response>{result}</tool_response>" in tok.decode(r["tokens"][t["end"]:t["obs_end"]])
    assert called >= 1  # the warm-start calls the tool in about a third of its samples


def test_builder_is_deterministic_and_the_shipped_model_matches_its_defaults(tmp_path):
    import inspect

    from safetensors.torch import load_file

    from tidal.recipes.tool_model import build_tool_model, held_out_success

    def quick(model, tok, rows):
        return held_out_success(model, tok, rows[:4], k=1)

    kw = {"steps": 3, "batch_size": 4, "train_size": 120, "eval_n": 20, "eval_every": 3, "evaluate": quick}
    a, b = build_tool_model(tmp_path / "a", **kw), build_tool_model(tmp_path / "b", **kw)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert a["history"][0]["loss"] == b["history"][0]["loss"] and a["history"][0]["step"] == 3
    # the shipped directory is what `tidal build-tool-model` makes: its record has the defaults
    shipped = json.loads((TOOL_MODEL_DIR / "tidal_build.json").read_text())
    defaults = {k: p.default for k, p in inspect.signature(build_tool_model).parameters.items()}
    for key in ("seed", "steps", "batch_size", "lr", "train_size"):
        assert shipped[key] == defaults[key], key
    assert shipped["habits"] == {"tool": 0.3, "direct": 0.6, "malformed": 0.1}


def test_shipped_model_starts_low_greedy():
    """The warm-start's greedy habit is the hasty guess: held-out success starts low (RL's room)."""
    from tidal.models import load_model, load_tokenizer
    from tidal.recipes.tool_model import held_out_success

    res = held_out_success(load_model(TOOL_MODEL_DIR), load_tokenizer(TOOL_MODEL_DIR), make_rows("test", 24, 0), k=0)
    assert res["n"] == 24 and res["accuracy"] <= 0.25 and res["failed"] == 0
