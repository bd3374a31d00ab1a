"""Tools: typed Python functions the policy calls, their schemas, the call format, execution.

A tool is an ordinary function, sync or async. Its OpenAI function schema is derived from
the signature and the docstring (`Tool.from_function`), so the schema the model is shown and
the arguments the function takes cannot drift apart:

- parameter types: int → integer, float → number, str → string, bool → boolean,
  list[T] → array of T, dict → object, Literal[...] → enum, Optional[T] / T | None → T or null;
  a parameter without a default is required; anything else (no annotation, *args, **kwargs,
  other classes) is refused when the tool is made, naming the function and the parameter;
- the description is the docstring's summary; a Google-style `Args:` section describes each
  parameter.

Calls are parsed in the Hermes/Qwen format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
several per turn (`parse_tool_calls`); the text outside them is kept. `execute` runs a turn's
calls concurrently and never raises: a malformed call, an unknown tool, bad arguments, a
timeout or an exception becomes an error observation that the policy sees
(`{"role": "tool", ..., "content": "error: ..."}`), a typed `ToolCallRecord` and a metric.

A tool returns text (anything else is rendered as JSON), or pictures: a PIL image, an
`ImageBlob` (tidal/images.py), or a list mixing text and pictures (strings, `{"type": "text"}`
and `{"type": "image"}` parts, images). Then the tool message's content is a list of parts,
`{"type": "image", "image": ImageBlob}` and `{"type": "text", "text": ...}`, in the order
returned, which a vision-language model's chat template renders as its image placeholders
(`tool_content`). `max_tool_output_chars` bounds the text parts only, together: a picture's
size is the image processor's business, not a character count.

Timeouts: an async tool is cancelled at its timeout. A sync tool runs in its own daemon
thread; at its timeout the call ends `timeout` and the policy moves on, but Python cannot kill
a thread, so the hung function keeps its thread (it never blocks the event loop or the
interpreter's exit). Tools that run code (or anything that may hang for good) must therefore
run it in `tidal.sandbox`, whose wall clock kills the process.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
import threading
import time
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from tidal.images import ImageBlob, ImageError, as_image, is_image_part
from tidal.types import ToolCallRecord

ERROR_KINDS = ("parse", "unknown", "args", "timeout", "raised", "limit")
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


class ToolDefinitionError(TypeError):
    """A function cannot be made a tool (its signature has no JSON schema); names the function."""


# ---------------------------------------------------------------------------------------------
# schema from a signature


def _type_schema(tp: Any, where: str) -> dict[str, Any]:
    """JSON schema of one annotation; `where` names the function and parameter for errors."""
    if tp is inspect.Parameter.empty:
        raise ToolDefinitionError(f"{where} has no type annotation")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is bool:  # before int: bool is a subclass of int
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if tp is dict or origin is dict:
        return {"type": "object"}
    if tp is list or origin is list:
        return {"type": "array", "items": _type_schema(args[0], where)} if args else {"type": "array"}
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or not kinds <= {str, int, bool}:
            raise ToolDefinitionError(f"{where}: a Literal must hold values of one type (str, int or bool), got {args}")
        return {**_type_schema(kinds.pop(), where), "enum": list(args)}
    if origin is Union or origin is types.UnionType:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = _type_schema(rest[0], where)
            if isinstance(inner.get("type"), str) and "enum" not in inner:
                return {**inner, "type": [inner["type"], "null"]}
            return {"anyOf": [inner, {"type": "null"}]}
        raise ToolDefinitionError(f"{where}: only Optional[T] unions are supported, got {tp}")
    raise ToolDefinitionError(f"{where}: type {tp!r} has no JSON schema (use int, float, str, bool, list, dict, "
                              "Literal or Optional)")


_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(summary, {argument: description}) of a Google-style docstring. The summary is the
    first paragraph; `Args:` entries are `name: text` or `name (type): text`, continued on
    more deeply indented lines."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary_lines: list[str] = []
    for line in lines:
        if not line.strip() or line.strip().endswith(":") and line.strip()[:-1] in _SECTIONS:
            break
        summary_lines.append(line.strip())
    args: dict[str, str] = {}
    in_args, current, indent = False, None, None
    for line in lines:
        stripped = line.strip()
        if not line.startswith((" ", "\t")) and stripped.endswith(":") and stripped[:-1] in _SECTIONS:
            in_args, current, indent = stripped[:-1] in ("Args", "Arguments", "Parameters"), None, None
            continue
        if not in_args or not stripped:
            continue
        level = len(line) - len(line.lstrip())
        m = _ARG_LINE.match(stripped)
        if m and (indent is None or level <= indent):
            indent, current = level, m.group(1).lstrip("*")
            args[current] = m.group(3).strip()
        elif current is not None and indent is not None and level > indent:
            args[current] = (args[current] + " " + stripped).strip()
    return " ".join(summary_lines), args


_SECTIONS = {"Args", "Arguments", "Parameters", "Returns", "Return", "Raises", "Yields", "Example", "Examples",
             "Note", "Notes"}


@dataclass
class Tool:
    """A callable the policy may call by name, with its OpenAI function schema."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]
    is_async: bool = False

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> Tool:
        """Derive the schema from `fn`'s signature and docstring (module docstring, rules)."""
        fname = name or getattr(fn, "__name__", None)
        if not fname or not re.fullmatch(r"[A-Za-z_][\w\-]{0,63}", fname):
            raise ToolDefinitionError(f"tool name {fname!r} of {fn!r} is not a valid function name")
        summary, arg_docs = parse_docstring(inspect.getdoc(fn))
        try:
            hints = typing.get_type_hints(fn, include_extras=False)
        except Exception as e:
            raise ToolDefinitionError(f"tool `{fname}`: cannot resolve its type annotations: {e}") from e
        props: dict[str, Any] = {}
        required: list[str] = []
        for p in inspect.signature(fn).parameters.values():
            where = f"tool `{fname}` parameter `{p.name}`"
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ToolDefinitionError(f"{where}: *args and **kwargs have no schema")
            if p.kind is p.POSITIONAL_ONLY:
                raise ToolDefinitionError(f"{where}: positional-only parameters cannot be passed by name")
            schema = _type_schema(hints.get(p.name, inspect.Parameter.empty), where)
            if arg_docs.get(p.name):
                schema["description"] = arg_docs[p.name]
            if p.default is p.empty:
                required.append(p.name)
            elif p.default is None or isinstance(p.default, (int, float, str, bool)):
                schema["default"] = p.default
            props[p.name] = schema
        unknown_docs = set(arg_docs) - set(props)
        if unknown_docs:
            raise ToolDefinitionError(f"tool `{fname}`: docstring describes unknown arguments {sorted(unknown_docs)}")
        parameters = {"type": "object", "properties": props, "required": required}
        return cls(fname, description if description is not None else summary, parameters, fn,
                   inspect.iscoroutinefunction(fn))

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema, as chat templates take it through `tools=`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def as_tools(tools: Iterable[Tool | Callable[..., Any]]) -> dict[str, Tool]:
    """Tools by name; plain functions are made tools. Two tools of one name are an error."""
    out: dict[str, Tool] = {}
    for t in tools:
        tool = t if isinstance(t, Tool) else Tool.from_function(t)
        if tool.name in out:
            raise ToolDefinitionError(f"two tools are named `{tool.name}`")
        out[tool.name] = tool
    return out


# ---------------------------------------------------------------------------------------------
# argument validation against the schema


class ArgumentError(ValueError):
    pass


def _coerce(value: Any, schema: dict[str, Any], path: str) -> Any:
    """`value` checked against `schema` (the subset `from_function` writes). Coercion only
    where no information is lost: an int where a number is wanted, an integral float
    (3.0) or a canonical integer string ("42") where an integer is wanted."""
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                return _coerce(value, option, path)
            except ArgumentError:
                pass
        raise ArgumentError(f"`{path}` does not match any allowed type")
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if value is None and "null" in kinds:
        return None
    kind = next((k for k in kinds if k != "null"), None)
    got = type(value).__name__ if value is not None else "null"
    if kind == "boolean":
        if not isinstance(value, bool):
            raise ArgumentError(f"`{path}` must be a boolean, got {got} {value!r}")
    elif kind == "integer":
        if isinstance(value, float) and math.isfinite(value) and value.is_integer() or isinstance(value, str) and re.fullmatch(r"-?\d{1,30}", value) and str(int(value)) == value:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentError(f"`{path}` must be an integer, got {got} {value!r}")
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ArgumentError(f"`{path}` must be a finite number, got {got} {value!r}")
        value = float(value)
    elif kind == "string":
        if not isinstance(value, str):
            raise ArgumentError(f"`{path}` must be a string, got {got} {value!r}")
    elif kind == "array":
        if not isinstance(value, list):
            raise ArgumentError(f"`{path}` must be an array, got {got}")
        if "items" in schema:
            value = [_coerce(v, schema["items"], f"{path}[{i}]") for i, v in enumerate(value)]
    elif kind == "object":
        if not isinstance(value, dict):
            raise ArgumentError(f"`{path}` must be an object, got {got}")
    elif kind is not None:
        raise ArgumentError(f"`{path}`: unsupported schema type {kind!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise ArgumentError(f"`{path}` must be one of {schema['enum']}, got {value!r}")
    return value


def validate_arguments(arguments: Any, parameters: dict[str, Any]) -> dict[str, Any]:
    """The arguments object checked against the tool's parameter schema; raises ArgumentError."""
    if not isinstance(arguments, dict):
        raise ArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    props = parameters.get("properties", {})
    unknown = [k for k in arguments if k not in props]
    if unknown:
        raise ArgumentError(f"unknown argument(s) {unknown} (expected: {list(props)})")
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        raise ArgumentError(f"missing required argument(s) {missing}")
    return {k: _coerce(v, props[k], k) for k, v in arguments.items()}


# ---------------------------------------------------------------------------------------------
# parsing calls


@dataclass
class ToolCall:
    """One call as the policy wrote it. `error` non-empty: the call is malformed (parse)."""

    call_id: str
    name: str
    arguments: dict[str, Any] | None
    raw: str  # the text between the tags
    error: str = ""

    @property
    def arguments_text(self) -> str:
        """The arguments as JSON text (OpenAI's `function.arguments`); the raw text when malformed."""
        if self.arguments is None:
            return self.raw.strip()
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedTurn:
    """`content` is the text outside the well-formed calls, stripped (whitespace between calls
    dropped); a malformed call stays in it verbatim, as text the policy wrote that is not a
    call, so the turn re-renders as it was generated. `calls` holds every call, malformed too."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


def _parse_call(body: str, call_id: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(call_id, "", None, body, f"the call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict):
        return ToolCall(call_id, "", None, body, f"the call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(call_id, "", None, body, 'the call has no "name" string')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI's wire form: the arguments object as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCall(call_id, name, None, body, f'"arguments" is a string that is not JSON ({e.msg})')
    if not isinstance(args, dict):
        return ToolCall(call_id, name, None, body, f'"arguments" must be a JSON object, got {type(args).__name__}')
    extra = set(obj) - {"name", "arguments"}
    if extra:
        return ToolCall(call_id, name, None, body, f'the call has keys other than "name" and "arguments": {sorted(extra)}')
    return ToolCall(call_id, name, args, body)


def parse_tool_calls(text: str, id_prefix: str = "call") -> ParsedTurn:
    """The calls of one turn and the text outside them. A `<tool_call>` that is never closed
    (the turn ran out of tokens, or the policy forgot the tag) is a malformed call. Call ids
    are `{id_prefix}_{i}`: deterministic, so the same actions give the same observations."""
    calls: list[ToolCall] = []
    outside: list[str] = []
    pos = 0
    for m in TOOL_CALL_RE.finditer(text):
        outside.append(text[pos : m.start()])
        call = _parse_call(m.group(1).strip(), f"{id_prefix}_{len(calls)}")
        calls.append(call)
        if call.error:
            outside.append(m.group(0))
        pos = m.end()
    rest = text[pos:]
    if OPEN_TAG in rest:
        body = rest.partition(OPEN_TAG)[2]
        calls.append(ToolCall(f"{id_prefix}_{len(calls)}", "", None, body,
                              f"`{OPEN_TAG}` is never closed by `{CLOSE_TAG}`"))
    outside.append(rest)
    content = "\n".join(piece.strip() for piece in outside if piece.strip())
    return ParsedTurn(content, calls)


def assistant_message(parsed: ParsedTurn) -> dict[str, Any]:
    """The turn in OpenAI shape: content outside the calls and `tool_calls`. Malformed calls
    are left out of `tool_calls` (they have no name or arguments to render)."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    calls = [c for c in parsed.calls if not c.error]
    if calls:
        msg["tool_calls"] = [{"id": c.call_id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments_text}} for c in calls]
    return msg


# ---------------------------------------------------------------------------------------------
# execution


def truncate(text: str, max_chars: int) -> str:
    """The first `max_chars` characters, then a marker saying how many were cut."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n...[truncated {len(text) - max_chars} chars]"


def _render_output(out: Any) -> str:
    if isinstance(out, str):
        return out
    try:
        return json.dumps(out, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(out)


def _is_picture(value: Any) -> bool:
    """An image a tool returned as a value (not a part): an ImageBlob or a PIL image."""
    if isinstance(value, ImageBlob):
        return True
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        return False
    return isinstance(value, Image.Image)


def _has_picture(item: Any) -> bool:

    return _is_picture(item) or is_image_part(item)


def tool_content(out: Any, max_chars: int, where: str = "tool output") -> tuple[str | list[dict[str, Any]], int]:
    """The content of the tool message that answers with `out`, and the characters of its text
    before truncation. Text (and anything without a picture) is one string cut to `max_chars`;
    a picture, or a list that holds one, is a list of parts in order: pictures as
    `{"type": "image", "image": ImageBlob}`, the rest as text parts that share the `max_chars`
    budget (a text part past it keeps only the truncation marker). Raises ImageError when a
    picture cannot be read."""
    if _has_picture(out):
        items = [out]
    elif isinstance(out, (list, tuple)) and any(_has_picture(x) for x in out):
        items = list(out)
    else:
        text = _render_output(out)
        return truncate(text, max_chars), len(text)
    parts: list[dict[str, Any]] = []
    budget, total = max_chars, 0
    for i, item in enumerate(items):
        if _is_picture(item) or is_image_part(item):
            value = item.get("image", item.get("image_url")) if isinstance(item, dict) else item
            if isinstance(value, dict) and "url" in value:  # OpenAI's {"image_url": {"url": ...}}
                value = value["url"]
            parts.append({"type": "image", "image": as_image(value, f"{where}, part {i}")})
            continue
        if isinstance(item, dict) and item.get("type") == "text":
            text = str(item.get("text", ""))
        else:
            text = _render_output(item)
        total += len(text)
        parts.append({"type": "text", "text": truncate(text, budget)})
        budget = max(0, budget - len(text))
    return parts, total


async def run_sync_in_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Run `fn` in a daemon thread of its own: a hung tool keeps its thread but never blocks
    the loop, a shared executor (whose threads it would use up) or the interpreter's exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def target() -> None:
        try:
            value, ok = fn(**kwargs), True
        except BaseException as e:  # noqa: BLE001 - carried to the awaiting coroutine
            value, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop closed while the tool ran (it had timed out): nobody waits
            pass

    threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await fut


@dataclass
class Execution:
    """The outcome of one turn's calls: tool messages (in call order), records and metrics."""

    messages: list[dict[str, Any]]
    records: list[ToolCallRecord]
    metrics: dict[str, float]


def empty_metrics() -> dict[str, float]:
    """Every tool metric at 0 (present on every turn, so step means count turns without calls)."""
    return {"tools/calls": 0.0, **{f"tools/errors/{k}": 0.0 for k in ERROR_KINDS}}


async def _run_one(call: ToolCall, tools: dict[str, Tool], timeout_s: float,
                   max_chars: int) -> tuple[str | list[dict[str, Any]], ToolCallRecord]:
    rec = ToolCallRecord(name=call.name, arguments=call.arguments_text, call_id=call.call_id)
    t0 = time.perf_counter()

    def fail(status: str, error: str) -> tuple[str, ToolCallRecord]:
        rec.status, rec.error, rec.duration_s = status, error, time.perf_counter() - t0
        return truncate(f"error: {error}", max_chars), rec

    if call.error:
        return fail("parse", f"malformed tool call: {call.error}")
    tool = tools.get(call.name)
    if tool is None:
        return fail("unknown", f"unknown tool `{call.name}` (available: {', '.join(sorted(tools)) or 'none'})")
    try:
        kwargs = validate_arguments(call.arguments, tool.parameters)
    except ArgumentError as e:
        return fail("args", f"bad arguments for `{tool.name}`: {e}")
    try:
        if tool.is_async:
            out = await asyncio.wait_for(tool.fn(**kwargs), timeout_s)
        else:
            out = await asyncio.wait_for(run_sync_in_thread(tool.fn, kwargs), timeout_s)
            if inspect.isawaitable(out):  # a sync function that returned a coroutine
                out = await asyncio.wait_for(out, max(0.0, timeout_s - (time.perf_counter() - t0)))
    except TimeoutError:
        return fail("timeout", f"`{tool.name}` did not answer within {timeout_s:g} s")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the tool's failure is the policy's observation
        return fail("raised", f"`{tool.name}` raised {type(e).__name__}: {e}")
    try:
        content, chars = tool_content(out, max_chars, f"`{tool.name}`'s output")
    except ImageError as e:
        return fail("raised", f"`{tool.name}` returned an image that cannot be read: {e}")
    rec.output_chars, rec.duration_s = chars, time.perf_counter() - t0
    return content, rec


async def execute(calls: list[ToolCall], tools: dict[str, Tool] | Iterable[Tool | Callable[..., Any]],
                  timeout_s: float = 10.0, max_output_chars: int = 2000,
                  max_calls: int | None = None) -> Execution:
    """Run `calls` concurrently and answer each with a tool message, in call order. Never
    raises for a failure of a call (see the module docstring); calls past `max_calls` are
    not run and answered with a `limit` error."""
    if timeout_s <= 0 or max_output_chars < 1:
        raise ValueError(f"execute: timeout_s ({timeout_s}) must be > 0 and max_output_chars ({max_output_chars}) >= 1")
    by_name = tools if isinstance(tools, dict) else as_tools(tools)
    run = calls if max_calls is None else calls[:max_calls]
    results = list(await asyncio.gather(*(_run_one(c, by_name, timeout_s, max_output_chars) for c in run)))
    for c in calls[len(run):]:
        rec = ToolCallRecord(name=c.name, arguments=c.arguments_text, call_id=c.call_id, status="limit",
                             error=f"more than {max_calls} tool calls in one turn: not run")
        results.append((f"error: {rec.error}", rec))
    metrics = empty_metrics()
    metrics["tools/calls"] = float(len(calls))
    messages = []
    for (content, rec), call in zip(results, calls):
        rec.output = content if isinstance(content, str) else \
            "".join(str(p.get("text", f"[{p.get('type')}]")) for p in content if isinstance(p, dict))
        if rec.status != "ok":
            metrics[f"tools/errors/{rec.status}"] += 1.0
        messages.append({"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": content})
    return Execution(messages, [r for _, r in results], metrics)
