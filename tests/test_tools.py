"""Tools: schema from a signature, the Hermes/Qwen call format, and execution that never raises
(every malformed-call case typed and counted), with timeouts, concurrency and truncation."""

from __future__ import annotations

import asyncio
import threading
from typing import Literal

import pytest

from tidal.envs.base import Action
from tidal.envs.tool_env import ToolEnv
from tidal.envs.tools import (
    ERROR_KINDS,
    Tool,
    ToolDefinitionError,
    assistant_message,
    execute,
    parse_tool_calls,
    truncate,
)


def search(query: str, limit: int = 5, mode: Literal["fast", "exact"] = "fast", tags: list[str] | None = None,
           weight: float = 1.0, strict: bool = False, page: int | None = None) -> str:
    """Search the index.

    Longer text that is not the summary.

    Args:
        query: what to look for,
            continued on a second line.
        limit (int): most results.
        mode: how to match.

    Returns:
        the hits
    """
    return f"{query}:{limit}:{mode}:{tags}:{weight}:{strict}:{page}"


def test_schema_from_signature_and_docstring():
    assert Tool.from_function(search).schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the index.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for, continued on a second line."},
                    "limit": {"type": "integer", "description": "most results.", "default": 5},
                    "mode": {"type": "string", "enum": ["fast", "exact"], "description": "how to match.",
                             "default": "fast"},
                    "tags": {"type": ["array", "null"], "items": {"type": "string"}, "default": None},
                    "weight": {"type": "number", "default": 1.0},
                    "strict": {"type": "boolean", "default": False},
                    "page": {"type": ["integer", "null"], "default": None},
                },
                "required": ["query"],
            },
        },
    }


async def _async_tool(x: int) -> int:
    """Double it."""
    return 2 * x


def test_async_tool_and_definition_errors():
    t = Tool.from_function(_async_tool)
    assert t.is_async and t.description == "Double it." and t.parameters["required"] == ["x"]

    def no_annotation(x):
        return x

    def star(*xs: int):
        return xs

    def odd_type(x: complex):
        return x

    def bad_doc(x: int):
        """Doc.

        Args:
            y: not a parameter
        """

    for fn, words in [(no_annotation, "`no_annotation` parameter `x` has no type annotation"),
                      (star, "`star` parameter `xs`: *args"), (odd_type, "`odd_type` parameter `x`: type"),
                      (bad_doc, "unknown arguments ['y']")]:
        with pytest.raises(ToolDefinitionError, match=words.replace("(", r"\(").replace("[", r"\[").replace("*", r"\*")):
            Tool.from_function(fn)


def test_parse_parallel_calls_and_text_outside():
    text = ('Let me compute.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call> done')
    p = parse_tool_calls(text, id_prefix="call_3")
    assert p.content == "Let me compute.\ndone"
    assert [(c.call_id, c.name, c.arguments, c.error) for c in p.calls] == [
        ("call_3_0", "a", {"x": 1}, ""), ("call_3_1", "b", {"y": 2}, "")]
    msg = assistant_message(p)
    assert msg["tool_calls"] == [
        {"id": "call_3_0", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
        {"id": "call_3_1", "type": "function", "function": {"name": "b", "arguments": '{"y": 2}'}}]
    assert parse_tool_calls("no call here").calls == []


@pytest.mark.parametrize("body, words", [
    ('{"name": "a", "arguments": {"x": 1}', "not valid JSON"),
    ('["a"]', "must be a JSON object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": "a", "arguments": [1]}', '"arguments" must be a JSON object'),
    ('{"name": "a", "arguments": "{oops"}', "string that is not JSON"),
    ('{"name": "a", "arguments": {}, "extra": 1}', "keys other than"),
])
def test_malformed_calls_parse_as_errors(body, words):
    p = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert len(p.calls) == 1 and words in p.calls[0].error
    # the malformed call stays in the content, as text the policy wrote
    assert p.content == f"<tool_call>{body}</tool_call>" and "tool_calls" not in assistant_message(p)


def test_unclosed_call_is_malformed():
    p = parse_tool_calls('ok <tool_call>{"name": "a", "arguments": {}}')
    assert len(p.calls) == 1 and "never closed" in p.calls[0].error and p.content.startswith("ok <tool_call>")


def _run(coro):
    return asyncio.run(coro)


def fails(x: int) -> str:
    raise KeyError("boom")


def echo(text: str, n: int = 1, scale: float = 1.0, flag: bool = False,
         mode: Literal["a", "b"] = "a", maybe: int | None = None) -> str:
    return f"{text}|{n}|{scale}|{flag}|{mode}|{maybe}"


def test_every_error_kind_is_an_observation_typed_and_counted():
    text = ("<tool_call>{bad json</tool_call>"
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": 3}}</tool_call>'
            '<tool_call>{"name": "fails", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": "hi", "n": 2}}</tool_call>')
    calls = parse_tool_calls(text).calls
    ex = _run(execute(calls, [echo, fails], timeout_s=5, max_output_chars=500))
    assert [r.status for r in ex.records] == ["parse", "unknown", "args", "raised", "ok"]
    assert ex.metrics == {"tools/calls": 5.0, "tools/errors/parse": 1.0, "tools/errors/unknown": 1.0,
                          "tools/errors/args": 1.0, "tools/errors/timeout": 0.0, "tools/errors/raised": 1.0,
                          "tools/errors/limit": 0.0}
    assert [m["role"] for m in ex.messages] == ["tool"] * 5
    assert [m["tool_call_id"] for m in ex.messages] == [f"call_{i}" for i in range(5)]
    contents = [m["content"] for m in ex.messages]
    assert all(c.startswith("error: ") for c in contents[:4])
    assert "not valid JSON" in contents[0] and "unknown tool `nope` (available: echo, fails)" in contents[1]
    assert "`text` must be a string, got int" in contents[2] and "raised KeyError: 'boom'" in contents[3]
    assert contents[4] == "hi|2|1.0|False|a|None" and ex.records[4].output_chars == len(contents[4])
    assert {k.removeprefix("tools/errors/") for k in ex.metrics if "errors" in k} == set(ERROR_KINDS)


@pytest.mark.parametrize("args, result", [
    ({"text": "t", "n": 3.0}, "t|3|1.0|False|a|None"),  # integral float → int: lossless
    ({"text": "t", "n": "42"}, "t|42|1.0|False|a|None"),  # canonical integer string → int: lossless
    ({"text": "t", "scale": 2}, "t|1|2.0|False|a|None"),  # int → number
    ({"text": "t", "maybe": None, "mode": "b"}, "t|1|1.0|False|b|None"),
])
def test_lossless_coercion(args, result):
    calls = parse_tool_calls(f'<tool_call>{{"name": "echo", "arguments": {__import__("json").dumps(args)}}}</tool_call>').calls
    ex = _run(execute(calls, [echo]))
    assert ex.records[0].status == "ok" and ex.messages[0]["content"] == result


@pytest.mark.parametrize("args, words", [
    ({"text": "t", "n": 3.5}, "must be an integer"),
    ({"text": "t", "n": "042"}, "must be an integer"),
    ({"text": "t", "n": True}, "must be an integer"),
    ({"text": "t", "flag": 1}, "must be a boolean"),
    ({"text": "t", "scale": "2"}, "must be a finite number"),
    ({"text": "t", "mode": "c"}, "must be one of ['a', 'b']"),
    ({"n": 1}, "missing required argument(s) ['text']"),
    ({"text": "t", "other": 1}, "unknown argument(s) ['other']"),
])
def test_bad_arguments(args, words):
    calls = parse_tool_calls(f'<tool_call>{{"name": "echo", "arguments": {__import__("json").dumps(args)}}}</tool_call>').calls
    ex = _run(execute(calls, [echo]))
    assert ex.records[0].status == "args" and words in ex.messages[0]["content"]


def test_calls_run_concurrently_sync_and_async():
    # Each tool waits for the other: run one after the other, both would time out.
    a_ev, b_ev = asyncio.Event(), asyncio.Event()

    async def ping() -> str:
        a_ev.set()
        await b_ev.wait()
        return "ping"

    async def pong() -> str:
        b_ev.set()
        await a_ev.wait()
        return "pong"

    barrier = threading.Barrier(2, timeout=5)

    def left() -> str:
        barrier.wait()
        return "left"

    def right() -> str:
        barrier.wait()
        return "right"

    text = "".join(f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>' for n in ("ping", "pong", "left", "right"))
    ex = _run(execute(parse_tool_calls(text).calls, [ping, pong, left, right], timeout_s=3))
    assert [m["content"] for m in ex.messages] == ["ping", "pong", "left", "right"]


def test_timeouts_async_and_hung_sync_tool():
    release = threading.Event()

    def hangs() -> str:
        release.wait(30)  # a sync tool that does not return (released at the end of the test)
        return "late"

    async def sleeps() -> str:
        await asyncio.sleep(30)
        return "late"

    text = '<tool_call>{"name": "hangs", "arguments": {}}</tool_call><tool_call>{"name": "sleeps", "arguments": {}}</tool_call>'
    try:
        ex = _run(execute(parse_tool_calls(text).calls, [hangs, sleeps], timeout_s=0.2))
    finally:
        release.set()
    assert [r.status for r in ex.records] == ["timeout", "timeout"]
    assert ex.metrics["tools/errors/timeout"] == 2.0
    assert ex.messages[0]["content"] == "error: `hangs` did not answer within 0.2 s"


def test_output_truncated_to_budget():
    def big() -> str:
        return "x" * 5000

    def structured() -> dict:
        return {"a": [1, 2]}

    text = '<tool_call>{"name": "big", "arguments": {}}</tool_call><tool_call>{"name": "structured", "arguments": {}}</tool_call>'
    ex = _run(execute(parse_tool_calls(text).calls, [big, structured], max_output_chars=100))
    assert ex.messages[0]["content"] == "x" * 100 + "\n...[truncated 4900 chars]"
    assert ex.records[0].output_chars == 5000 and ex.records[0].status == "ok"
    assert ex.messages[1]["content"] == '{"a": [1, 2]}'
    assert truncate("abc", 3) == "abc"


def test_calls_past_the_limit_are_not_run():
    ran = []

    def tick(i: int) -> str:
        ran.append(i)
        return str(i)

    text = "".join(f'<tool_call>{{"name": "tick", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(4))
    ex = _run(execute(parse_tool_calls(text).calls, [tick], max_calls=2))
    assert sorted(ran) == [0, 1] and [r.status for r in ex.records] == ["ok", "ok", "limit", "limit"]
    assert ex.metrics["tools/calls"] == 4.0 and ex.metrics["tools/errors/limit"] == 2.0


class EchoEnv(ToolEnv):
    name = "echo_env"
    tool_functions = (echo,)
    default_system_prompt = "Use tools."


def test_tool_env_turns():
    env = EchoEnv({"prompt": "say hi", "answer": "hi"}, seed=3, max_tool_output_chars=4)

    async def episode():
        msgs = await env.reset()
        first = await env.step(Action('<tool_call>{"name": "echo", "arguments": {"text": "hello"}}</tool_call>'))
        last = await env.step(Action("<answer>hi</answer>", turn=1))
        await env.close()
        return msgs, first, last

    msgs, first, last = _run(episode())
    assert msgs == [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "say hi"}]
    assert env.tools == [Tool.from_function(echo).schema] and env.closed
    assert not first.done and first.messages == [
        {"role": "tool", "tool_call_id": "call_0_0", "name": "echo", "content": "hell\n...[truncated 20 chars]"}]
    assert first.assistant_message == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "echo", "arguments": '{"text": "hello"}'}}]}
    assert first.metrics["tools/calls"] == 1.0 and [r.status for r in first.tool_calls] == ["ok"]
    assert last.done and last.messages == [] and last.metrics["tools/calls"] == 0.0
    assert all(last.metrics[f"tools/errors/{k}"] == 0.0 for k in ERROR_KINDS)


def test_tool_env_bad_config_is_named():
    with pytest.raises(ValueError, match="no `prompt` column"):
        EchoEnv({"question": "x"})
    with pytest.raises(ValueError, match="tool_timeout_s must be > 0"):
        EchoEnv({"prompt": "x"}, tool_timeout_s=0)
