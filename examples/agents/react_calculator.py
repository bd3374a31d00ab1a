"""A ReAct-style agent with one tool, written only against the `openai` client: it knows
nothing of tidal. tidal trains it unchanged (examples/openai_agent.yaml): the client it is
given points at tidal's gateway, which serves the policy being trained.

Run it against any OpenAI-compatible server too:

    python examples/agents/react_calculator.py http://127.0.0.1:8000/v1 "What is 347 * 28?"
"""

from __future__ import annotations

import ast
import json
import operator
import sys

SYSTEM = "Solve the problem. End with <answer>N</answer>."
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": "integers with + - * / and parentheses, e.g. (12 + 3) * 4"}},
            "required": ["expression"],
        },
    },
}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("only integers, + - * / and parentheses")

    value = ev(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.10g}"


def solve(row, client, model: str = "gpt-4o-mini", max_steps: int = 4) -> str:
    """Ask, run the calculator on every tool call, ask again; the first reply without a call
    is the answer."""
    question = row["prompt"][-1]["content"] if isinstance(row["prompt"], list) else row["prompt"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reply = None
    for _ in range(max_steps):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        if not reply.tool_calls:
            return reply.content or ""
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as e:  # noqa: BLE001 - the model sees its mistake
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})
    return (reply.content or "") if reply is not None else ""


if __name__ == "__main__":
    import openai

    base_url, question = sys.argv[1], sys.argv[2]
    print(solve({"prompt": question}, openai.OpenAI(base_url=base_url, api_key="none")))
