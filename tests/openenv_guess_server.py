"""An OpenEnv environment written as OpenEnv's own docs and `openenv init` template show (its
`Action`, `Observation` and `Environment` classes, served by `create_app`), for
tests/test_envhub_openenv.py. It runs in the Python that has the `openenv` package
(.venv-openenv, scripts/setup_openenv.sh), never in tidal's: `uvicorn openenv_guess_server:app`.

Guess the number: a secret in 1..20 drawn from the reset seed; each step's `message` is a guess
(the first integer in it); the observation says higher or lower; reward 1 and done on the secret,
done after 6 guesses. `reset(die_once=PATH)` is the tests' failure hook: the first step of the
first episode that finds no file at PATH creates it and kills this server (SIGKILL), as a server
that crashes mid-episode does; `reset(hang_s=S)` makes every step sleep S seconds, as a hung one does.
"""

import os
import random
import re
import signal
import time
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_GUESSES = 6


class GuessAction(Action):
    """A guess: the first integer in the message."""

    message: str = Field(..., description="The player's turn, with a number in it")


class GuessObservation(Observation):
    """What the player is told."""

    prompt: str = Field(default="", description="The game's answer to the last guess")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True  # each session has its own instance and state

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = 0
        self._die_once: str | None = None
        self._hang_s = 0.0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              die_once: str | None = None, hang_s: float = 0.0, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._secret = random.Random(seed).randint(1, 20)
        self._die_once = die_once
        self._hang_s = hang_s
        return GuessObservation(prompt="Guess my number between 1 and 20. Answer with a number.",
                                done=False, reward=0.0)

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        if self._die_once and not os.path.exists(self._die_once):
            open(self._die_once, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self._hang_s)
        self._state.step_count += 1
        found = re.search(r"-?\d+", action.message)
        guess = int(found.group()) if found else None
        if guess == self._secret:
            return GuessObservation(prompt="Correct!", done=True, reward=1.0)
        done = self._state.step_count >= MAX_GUESSES
        hint = "not a number" if guess is None else ("higher" if guess < self._secret else "lower")
        return GuessObservation(prompt=f"{guess}: {hint}. Guess again.", done=done, reward=0.0,
                                metadata={"guesses": self._state.step_count})

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
