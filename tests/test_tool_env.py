"""ToolEnv as a user writes it (docs/agents.md): the tools attribute, env_args split between the
row generator and the constructor, and the example environments in examples/envs/."""

from __future__ import annotations

import asyncio
import json

import pytest

from tidal.config import ConfigError, load_config
from tidal.envs.base import Action
from tidal.envs.tool_env import ToolEnv
from tidal.runtime.tasks import build_task


def double(n: int) -> int:
    """Double a number.

    Args:
        n: the number
    """
    return 2 * n


def _call(env: ToolEnv, name: str, arguments: dict) -> dict:
    async def go():
        await env.reset()
        out = await env.step(Action(f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'))
        return out

    return asyncio.run(go())


def test_tools_class_attribute_lists_the_tool_functions():
    """`tools = [fn]` (what people write; the old docstring said so) gives an env with that tool;
    on main it silently gave an env with none (every call `unknown`)."""

    class Doubler(ToolEnv):
        tools = [double]  # noqa: RUF012 - a list, as people write it

    env = Doubler({"prompt": "Double 21."})
    assert [t["function"]["name"] for t in env.tools] == ["double"]
    out = _call(env, "double", {"n": 21})
    assert out.tool_calls[0].status == "ok" and out.messages[0]["content"] == "42"

    class ByTheOtherName(ToolEnv):  # the documented attribute still works, and means the same
        tool_functions = (double,)

    assert ByTheOtherName({"prompt": "x"}).tools == env.tools


def test_tools_class_attribute_that_is_not_functions_is_refused_at_definition():
    with pytest.raises(TypeError, match=r"\.tools must list the tool functions"):
        class Schemas(ToolEnv):  # defining it is the test
            tools = ({"type": "function", "function": {"name": "double"}},)
    with pytest.raises(TypeError, match=r"sets both `tools` and `tool_functions`"):
        class Both(ToolEnv):
            tools = (double,)
            tool_functions = (double,)


LEVELS = """
from tidal.envs.tool_env import ToolEnv


def double(n: int) -> int:
    \"\"\"Double a number.\"\"\"
    return 2 * n


class Levels(ToolEnv):
    tools = [double]

    @classmethod
    def rows(cls, split: str, n: int, seed: int, level: int = 1) -> list[dict]:
        return [{"prompt": f"Double {level * 10 + i}.", "answer": str(2 * (level * 10 + i))} for i in range(n)]

    def __init__(self, row: dict, seed: int = 0, bonus: float = 0.0, **env_args):
        super().__init__(row, seed, **env_args)
        self.bonus = bonus
"""


def _task(tmp_path, *overrides: str):
    (tmp_path / "levels.py").write_text(LEVELS)
    return build_task(load_config(None, [f"task.env={tmp_path / 'levels.py'}:Levels", "task.train_size=2",
                                         "task.eval_size=1", *overrides]).task)


def test_env_args_split_between_rows_and_the_constructor(tmp_path):
    """rows() gets the keys it names (`level`), the constructor the rest; on main the
    constructor got `level` too (a TypeError here, or a dummy parameter to swallow it)."""
    task = _task(tmp_path, "task.env_args={level: 3, bonus: 0.5, tool_timeout_s: 2.0}")
    assert task.train_rows[0]["prompt"] == "Double 30."  # rows() got `level`
    assert task.env_args == {"bonus": 0.5, "tool_timeout_s": 2.0}  # ... and the constructor did not
    env = task.make_env(task.train_rows[0])
    assert env.tool_timeout_s == 2.0 and env.bonus == 0.5


def test_env_arg_neither_takes_is_named(tmp_path):
    (tmp_path / "strict.py").write_text(LEVELS.replace(", bonus: float = 0.0, **env_args", "")
                                        .replace("super().__init__(row, seed, **env_args)", "super().__init__(row, seed)")
                                        .replace("self.bonus = bonus", "pass"))
    with pytest.raises(ConfigError, match=r"task.env_args.levle.*neither in its constructor.*nor in rows\(\) \(level\)"):
        build_task(load_config(None, [f"task.env={tmp_path / 'strict.py'}:Levels", "task.env_args.levle=2"]).task)


def test_tool_arith_kinds_go_to_rows_only():
    from tidal.envs.tool_arith import ToolArithEnv

    task = build_task(load_config(None, ["task.env=tool_arith", "task.train_size=4", "task.eval_size=2",
                                         "task.env_args={kinds: [mul], max_calls_per_turn: 2}"]).task)
    assert {r["kind"] for r in task.train_rows} == {"mul"} and task.env_args == {"max_calls_per_turn": 2}
    with pytest.raises(TypeError):  # an episode no longer takes (and drops) the generator's argument
        ToolArithEnv(task.train_rows[0], kinds=["mul"])
