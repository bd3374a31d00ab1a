"""A verifiers ToolEnv written as verifiers' docs show: a typed tool function with a docstring,
a dataset, a rubric that checks the final answer."""

import verifiers as vf
from datasets import Dataset


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers, + and -.

    Args:
        expression: e.g. "12 + 7 - 3"
    """
    allowed = set("0123456789+- ")
    if not set(expression) <= allowed:
        raise ValueError(f"only integers, + and - are allowed: {expression!r}")
    return str(eval(expression))  # restricted to digits, + and - above


def load_environment(n: int = 16, **kwargs):
    dataset = Dataset.from_list([{"question": f"What is {12 + i} + {30 - i}?", "answer": "42"} for i in range(n)])

    def correct(completion, answer, **kwargs) -> float:
        last = completion[-1]
        return 1.0 if answer in str(getattr(last, "content", "") or "") else 0.0

    return vf.ToolEnv(dataset=dataset, tools=[calculator], rubric=vf.Rubric(funcs=[correct]), max_turns=4, **kwargs)
