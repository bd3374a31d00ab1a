"""A verifiers MultiTurnEnv written as verifiers' docs show: `env_response` answers each guess
with a hint, a `@vf.stop` condition ends the game when the guess is right, a rubric scores it."""

import verifiers as vf
from datasets import Dataset


class GuessEnv(vf.MultiTurnEnv):
    async def setup_state(self, state):
        state["guesses"] = 0
        return state

    @vf.stop
    async def solved(self, state) -> bool:
        return bool(state["trajectory"]) and state["trajectory"][-1]["completion"][-1].content.strip() == state["answer"]

    async def env_response(self, messages, state, **kwargs):
        state["guesses"] += 1
        guess = int(messages[-1].content.strip() or 0)
        return [{"role": "user", "content": "higher" if guess < int(state["answer"]) else "lower"}]


def load_environment(**kwargs):
    dataset = Dataset.from_list([{"question": "Guess my number (1-9).", "answer": str(n)} for n in (3, 7)])

    def won(completion, answer, **kwargs) -> float:
        return 1.0 if completion[-1].content.strip() == answer else 0.0

    def guesses(state, **kwargs) -> float:
        return float(state["guesses"])

    return GuessEnv(dataset=dataset, rubric=vf.Rubric(funcs=[won, guesses], weights=[1.0, 0.0]), max_turns=6, **kwargs)
