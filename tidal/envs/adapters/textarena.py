"""TextArena games as tidal multi-turn environments: `task.env: textarena:GAME_ID`.

A TextArena game is made with `textarena.make(GAME_ID, **env_args)` and played as its docs show:
`reset(num_players, seed)`, then `get_observation()` and `step(action)` until done, and `close()`,
which is the only place a TextArena game gives its rewards. What maps to what:

- rows: the game has no dataset; each row is a seed (`task.train_size` train seeds from
  `task.seed`, `task.eval_size` held-out seeds from a distinct range), so an episode is one game;
- the observation (TextArena gives the whole game log each time) reaches the policy as a user
  message: the first in full, later ones as what was added since the last (the policy's own turn
  is already in the conversation);
- the policy's whole turn is the action (TextArena's games find their move in it, e.g. `[12]`);
- the reward is player 0's reward from `close()`, as the part `game`, on the last turn; the game's
  info for the player (`invalid_move`, `turn_count`) becomes metrics.

Two-player games: `env_args.opponent` names a fixed, scripted opponent, a function
`opponent(observation: str) -> str` (a dotted or file path; `first_available` below plays the
first of the moves the game lists as available), which plays player 1 inside the episode; the
policy is player 0. The policy never plays itself here (no self-play).

Global random: `reset(seed)` seeds Python's global `random`, and games draw from it while they
play, so two episodes in one process would disturb each other. Each episode here keeps its own
`random` state and swaps it in around every call into its game under one process-wide lock (and
puts the caller's state back), so concurrent episodes are isolated and a seed gives the same
game whatever else runs beside it.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from tidal.envs.base import Action, Message, StepResult
from tidal.importing import import_object

PREFIX = "textarena:"
EVAL_SEED_OFFSET = 1_000_003
_RANDOM_LOCK = threading.Lock()  # the global `random` is one per process


def env_class(game_id: str) -> type:
    """The tidal environment class that plays TextArena game `game_id`."""
    return type(f"TextArena_{game_id}", (TextArenaEnv,), {"game_id": game_id, "name": f"{PREFIX}{game_id}"})


class TextArenaEnv:
    game_id: ClassVar[str] = ""
    default_reward: ClassVar[str | None] = None  # the game's reward from close() is the whole reward

    def __init__(self, row: dict[str, Any], seed: int = 0, opponent: str | None = None, **env_args: Any):
        import textarena

        self.opponent = import_object(opponent, "task.env_args.opponent") if opponent else None
        self.players = 2 if opponent else 1
        try:
            self.game = textarena.make(self.game_id, **env_args)
        except Exception as e:  # its registry raises plain exceptions for unknown ids and bad kwargs
            raise ValueError(f"`task.env: {PREFIX}{self.game_id}`: textarena cannot make it with env_args "
                             f"{env_args}: {type(e).__name__}: {e}") from e
        self.game_seed = int(row.get("game_seed", seed))
        self._random = random.Random(self.game_seed).getstate()  # this episode's global-random state
        self._seen = ""
        self.closed = False

    @classmethod
    def rows(cls, split: str, n: int, seed: int, /, **env_args: Any) -> list[dict[str, Any]]:
        base = seed if split == "train" else seed + EVAL_SEED_OFFSET
        return [{"prompt": "", "game_seed": base + i, "task_id": f"{cls.game_id}-{base + i}"} for i in range(n)]

    def _isolated(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn` with this episode's global-random state swapped in (and the caller's put back)."""
        with _RANDOM_LOCK:
            outer = random.getstate()
            random.setstate(self._random)
            try:
                return fn(*args, **kwargs)
            finally:
                self._random = random.getstate()
                random.setstate(outer)

    def _observe(self) -> str:
        _, observation = self._isolated(self.game.get_observation)
        text = observation if isinstance(observation, str) else str(observation)
        new = text.removeprefix(self._seen)
        self._seen = text
        return new.strip() or "(no change)"

    async def reset(self) -> list[Message]:
        self._seen = ""
        self._isolated(self.game.reset, num_players=self.players, seed=self.game_seed)
        self._opponent_moves()  # when the opponent opens
        return [{"role": "user", "content": self._observe()}]

    def _opponent_moves(self) -> bool:
        """The scripted opponent plays until it is player 0's turn; whether the game ended."""
        done = False
        while self.opponent is not None and not done:
            player, observation = self._isolated(self.game.get_observation)
            if player == 0:
                break
            done, _ = self._isolated(self.game.step, self.opponent(observation if isinstance(observation, str)
                                                                   else str(observation)))
        return done

    async def step(self, action: Action) -> StepResult:
        done, _ = self._isolated(self.game.step, action.text)
        done = done or self._opponent_moves()
        if not done and not action.last_turn:
            return StepResult(messages=[{"role": "user", "content": self._observe()}], done=False)
        rewards, info = self._isolated(self.game.close)
        self.closed = True
        mine = (info or {}).get(0, {})
        metrics = {f"textarena/{k}": float(v) for k, v in mine.items() if isinstance(v, (bool, int, float))}
        reward = float((rewards or {}).get(0, 0.0)) if done else 0.0  # out of turns: the game did not end
        metrics["textarena/finished"] = float(done)
        return StepResult(reward=reward, reward_parts={"game": reward}, done=True, metrics=metrics)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._isolated(self.game.close)
            except Exception:  # noqa: BLE001, S110 - a game closed mid-play may refuse; nothing is held
                pass


def first_available(observation: str) -> str:
    """A scripted opponent: the first move of the last `Available Moves:` list of the observation
    (TextArena's board games list them as `'[4]'`), or `[0]` when there is none."""
    lines = [line for line in observation.splitlines() if "Available Moves" in line]
    moves = re.findall(r"\[[^\]]+\]", lines[-1]) if lines else []
    return moves[0] if moves else "[0]"
