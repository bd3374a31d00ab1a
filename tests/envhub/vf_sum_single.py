"""A verifiers SingleTurnEnv written as verifiers' docs show (not adapted to tidal): a dataset of
questions and answers, a system prompt and one few-shot pair, an XMLParser, a Rubric of two
functions with weights. `raise_on_odd=True` makes the second function raise on odd examples
(tidal's reward_error test)."""

import verifiers as vf
from datasets import Dataset


def load_environment(n: int = 32, raise_on_odd: bool = False, **kwargs):
    rows = [{"question": f"What is {10 + i} + {20 + 2 * i}?", "answer": str(30 + 3 * i)} for i in range(n)]
    dataset = Dataset.from_list(rows)
    eval_dataset = Dataset.from_list([{"question": f"What is {40 + i} - {i}?", "answer": "40"} for i in range(8)])
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct_answer(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    def uses_format(completion, state, **kwargs) -> float:
        if raise_on_odd and int(state["example_id"]) % 2:
            raise RuntimeError("the format checker failed")
        return 1.0 if parser.parse_answer(completion) is not None else 0.0

    rubric = vf.Rubric(funcs=[correct_answer, uses_format], weights=[1.0, 0.2], parser=parser)
    return vf.SingleTurnEnv(dataset=dataset, eval_dataset=eval_dataset, system_prompt="Answer in <answer> tags.",
                            few_shot=[{"role": "user", "content": "What is 1 + 1?"},
                                      {"role": "assistant", "content": "<answer>2</answer>"}],
                            parser=parser, rubric=rubric, **kwargs)
