"""code: write a function that passes hidden unit tests, with execution feedback.

The policy sees a problem (a signature, a description and a few examples; never the hidden
tests) and has two tools, called in the Hermes format `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` (tidal.envs.tools):

- `run_python(code)` runs code in the episode's sandboxed Python session (tidal.sandbox
  `PythonSession`: one namespace for the whole episode, a final bare expression is shown) and
  answers with its output, truncated to `max_tool_output_chars`;
- `submit(code)` hands in the program and ends the episode.

A turn without a tool call also ends it: its last ```python block is the submission (the
convention for templates and models without tools); a turn without one submits nothing.

The choice made: the environment grades the submission itself, in its final step, with the
code verifier (`tidal.rewards.code.CodeReward`): a fresh sandbox, the row's original `tests`,
and nothing of the episode's session (its files, its namespace) is there, so what the policy
did while exploring cannot change the grade. The reward is that step's per-turn reward,
`{"correct": 0 or 1}`, and `default_reward` is None (a `task.reward` adds to it). A sandbox
that cannot run the tests is an infrastructure failure: the episode ends `reward_error`,
never 0; a sandbox that cannot run a `run_python` call ends it `env_error`.

Rows: a shipped set of small problems, `examples/data/code_problems.jsonl` (prompt, tests,
entry_point, reference solution; `tests/test_code_env.py` checks every reference passes).
`CodeEnv.rows(split, n, seed)` gives the train or held-out split: a problem is held out when
a hash of its id falls in one bucket of four, whatever the seed, so the splits never share a
problem; the seed orders the rows. Any JSONL with `prompt` and `tests` columns works too
(`task.dataset`, or `env_args.problems` for the split).

Reproducibility: call ids are numbered by turn and position, the session's outputs are those
of the code; the same actions give the same observations unless the code itself reads a
clock or randomness (the sandboxed interpreter runs with hash randomization, so printing a
set of strings can differ).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ValidationError

from tidal.envs.base import Action, Message, RewardError, StepResult
from tidal.envs.loop_scoped import loop_scoped
from tidal.envs.tool_env import ToolEnv
from tidal.rewards.code import FENCE_RE, CodeReward
from tidal.sandbox import PythonSession, SandboxConfig, SandboxPool, SandboxResult, SandboxStatus

PROBLEMS = Path(__file__).resolve().parents[2] / "examples" / "data" / "code_problems.jsonl"
HELD_OUT_BUCKETS = 4
SYSTEM_PROMPT = (
    "Solve the programming problem in Python. You can test code in a Python session (it keeps its "
    "variables between runs) with\n"
    '<tool_call>{"name": "run_python", "arguments": {"code": "print(1 + 1)"}}</tool_call>\n'
    "and read its output. When your solution is ready, hand it in with\n"
    '<tool_call>{"name": "submit", "arguments": {"code": "def f(x):\\n    return x"}}</tool_call>\n'
    "or answer without a tool call, ending with the solution in a ```python block. Hidden tests grade it."
)

_GRADERS: dict[str, CodeReward] = {}


async def loop_pool(config: SandboxConfig) -> SandboxPool:
    """The sandbox pool of the running event loop for `config` (made on first use, closed
    with the loop: tidal.envs.loop_scoped)."""
    return await loop_scoped("sandbox:" + config.model_dump_json(), lambda: SandboxPool(config))


def sandbox_config(sandbox: dict[str, Any] | SandboxConfig | None, env: str) -> SandboxConfig:
    """`env_args.sandbox` (SandboxConfig fields) validated, naming the key on an error. The
    default has no warm sandboxes: each session starts its own (~50 ms)."""
    if isinstance(sandbox, SandboxConfig):
        return sandbox
    try:
        return SandboxConfig.model_validate({"warm": 0, **(sandbox or {})})
    except ValidationError as e:
        raise ValueError(f"{env}: env_args.sandbox is not a valid sandbox config: {e}") from None


def last_python_block(text: str) -> str | None:
    """The last complete ```python block of a turn, or None."""
    blocks = FENCE_RE.findall(text)
    return blocks[-1] if blocks else None


def load_problems(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The problems of a JSONL file (default: the shipped set), each checked for `prompt` and `tests`."""
    p = Path(path) if path is not None else PROBLEMS
    if not p.is_file():
        raise ValueError(f"code: problem file `{p}` does not exist")
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"code: line {i} of `{p}` is not JSON: {e}") from None
        row = row if isinstance(row, dict) else {}
        missing = [k for k in ("prompt", "tests") if not isinstance(row.get(k), str) or not row[k].strip()]
        if missing:
            raise ValueError(f"code: line {i} of `{p}` must be an object with non-empty text columns {missing} "
                             f"(columns: {sorted(row)})")
        row.setdefault("task_id", f"code-{i}")
        rows.append(row)
    return rows


def is_held_out(task_id: str) -> bool:
    return hashlib.sha256(task_id.encode()).digest()[0] % HELD_OUT_BUCKETS == 0


def _describe_kill(result: SandboxResult, timeout_s: float) -> str:
    why = {SandboxStatus.TIMEOUT: f"it ran past {timeout_s:g} s",
           SandboxStatus.MEMORY: "it ran out of memory",
           SandboxStatus.OUTPUT_LIMIT: "it wrote too much output",
           SandboxStatus.KILLED: f"it was killed by signal {result.signal}"}.get(result.status, result.status.value)
    return f"[killed: {why}; the Python session is reset and its variables are gone]"


class CodeEnv(ToolEnv):
    """`CodeEnv(row, seed, **env_args)`: the row's problem, a Python session, a submission graded
    against the row's hidden `tests`.

    env_args: `max_turns` (the env ends the episode, graded 0 if nothing was submitted, after
    this many turns; keep rollout.max_turns at least this), `run_timeout_s` (wall clock of one
    `run_python` call), `max_tool_output_chars`, `max_calls_per_turn`, `system_prompt`,
    `sandbox` (SandboxConfig fields for the session and the grader), `grade_limits` (sandbox
    limits of the grading run), `problems` (the JSONL of `rows`). `pool` (a SandboxPool,
    not from YAML) shares one pool, as tests do.
    """

    name: ClassVar[str] = "code"
    default_system_prompt: ClassVar[str] = SYSTEM_PROMPT
    default_reward: ClassVar[str | None] = None  # the env grades in its final step

    @classmethod
    def rows(cls, split: str, n: int, seed: int, problems: str | None = None, **env_args: Any) -> list[dict[str, Any]]:
        """Up to `n` distinct problems of `split` ("train" or "test"), in an order drawn from
        `seed` (the split itself does not depend on the seed)."""
        if split not in ("train", "test"):
            raise ValueError(f"code: split must be 'train' or 'test', got {split!r}")
        rows = [r for r in load_problems(problems) if is_held_out(str(r["task_id"])) == (split == "test")]
        if not rows:
            raise ValueError(f"code: the problem file has no {split} problems")
        random.Random(f"code-{split}-{seed}").shuffle(rows)
        return rows[:n]

    def __init__(self, row: dict[str, Any], seed: int = 0, *, max_turns: int = 6, run_timeout_s: float = 5.0,
                 max_tool_output_chars: int = 1500, max_calls_per_turn: int = 4, system_prompt: str | None = None,
                 sandbox: dict[str, Any] | SandboxConfig | None = None, grade_limits: dict[str, Any] | None = None,
                 problems: str | None = None, pool: SandboxPool | None = None):
        if not isinstance(row.get("tests"), str) or not row["tests"].strip():
            raise ValueError(f"code: row {row.get('task_id', '?')} has no `tests` column (columns: {sorted(row)})")
        if max_turns < 1 or run_timeout_s <= 0:
            raise ValueError(f"code: env_args.max_turns ({max_turns}) must be >= 1 and run_timeout_s "
                             f"({run_timeout_s}) > 0")
        # Calls of one turn share the session one at a time (a lock), so the turn's last call may
        # wait for all the others: its tool timeout covers them, and the session's own wall clock
        # (which kills the code) always comes first.
        super().__init__(row, seed, tools=[self.run_python, self.submit], system_prompt=system_prompt,
                         tool_timeout_s=run_timeout_s * max_calls_per_turn + 30.0,
                         max_tool_output_chars=max_tool_output_chars, max_calls_per_turn=max_calls_per_turn)
        self.max_turns = max_turns
        self.run_timeout_s = run_timeout_s
        self.sandbox = sandbox_config(sandbox, "code")
        self.grade_limits = dict(grade_limits or {})
        self._pool = pool
        # RLIMIT_CPU counts over a session's whole life: room for every run the episode may make.
        self._session_limits = {"wall_s": run_timeout_s,
                                "cpu_s": max(10, math.ceil(run_timeout_s * max_turns * max_calls_per_turn))}
        self._session: PythonSession | None = None
        self._lock = asyncio.Lock()
        self._submission: str | None = None
        self._infra_error = ""
        self._metrics: dict[str, float] = {}

    async def reset(self) -> list[Message]:
        await self._close_session()
        self._submission, self._infra_error = None, ""
        return await super().reset()

    # -- tools ------------------------------------------------------------------------------
    async def run_python(self, code: str) -> str:
        """Run Python code in this episode's session (variables persist between runs) and show its output.

        Args:
            code: the code to run; the value of a final bare expression is printed
        """
        async with self._lock:
            self._metrics["code/runs"] = self._metrics.get("code/runs", 0.0) + 1.0
            if self._session is None or self._session.ended is not None:
                pool = self._pool or await loop_pool(self.sandbox)
                self._session = await pool.python_session(limits=self._session_limits)
            result = await self._session.run(code, wall_s=self.run_timeout_s)
            if result.status is SandboxStatus.SANDBOX_ERROR:
                self._infra_error = f"the sandbox could not run `run_python`: {result.error}"
                raise RuntimeError("the sandbox failed (infrastructure); the episode ends")
            out = result.stdout + result.stderr
            if result.status is not SandboxStatus.OK:
                self._metrics["code/run_killed"] = self._metrics.get("code/run_killed", 0.0) + 1.0
                out += ("\n" if out and not out.endswith("\n") else "") + _describe_kill(result, self.run_timeout_s)
            elif result.exit_code != 0:
                self._metrics["code/run_errors"] = self._metrics.get("code/run_errors", 0.0) + 1.0
            if result.status is SandboxStatus.OK and self._session.ended is not None:
                out += "[the Python session ended; the next run starts a new one]"
            return out if out.strip() else "(no output)"

    async def submit(self, code: str) -> str:
        """Hand in your solution; it is graded by hidden tests and the episode ends.

        Args:
            code: the complete program (the function or class the problem asks for)
        """
        if self._submission is None:  # the first submission of a turn counts
            self._submission = code
        return "submitted"

    # -- turns ------------------------------------------------------------------------------
    async def step(self, action: Action | str) -> StepResult:
        turn = self.turn
        self._metrics = {"code/runs": 0.0, "code/run_errors": 0.0, "code/run_killed": 0.0}  # on every turn
        result = await super().step(action)
        if self._infra_error:
            raise RuntimeError(f"code: {self._infra_error}")
        result.metrics = {**result.metrics, **self._metrics}
        if result.done:  # a turn without tool calls (final_turn graded it)
            return result
        if self._submission is not None:
            graded = await self._grade(self._submission)
        elif turn + 1 >= self.max_turns:
            graded = self._ungraded("code/out_of_turns")
        else:
            return result
        graded.messages, graded.tool_calls, graded.assistant_message = [], result.tool_calls, result.assistant_message
        graded.metrics = {**result.metrics, **graded.metrics}
        return graded

    async def final_turn(self, action: Action) -> StepResult:
        program = last_python_block(action.text)
        if program is None:
            return self._ungraded("code/no_program")
        return await self._grade(program)

    @staticmethod
    def _final_metrics(submitted: bool, why: str = "") -> dict[str, float]:
        return {"code/submitted": float(submitted), "code/no_program": float(why == "code/no_program"),
                "code/out_of_turns": float(why == "code/out_of_turns")}

    def _ungraded(self, why: str) -> StepResult:
        return StepResult(reward=0.0, reward_parts={"correct": 0.0}, done=True, metrics=self._final_metrics(False, why))

    async def _grade(self, program: str) -> StepResult:
        """The verifier's grade: a fresh sandbox, the original tests, none of the session's state."""
        try:
            correct = float((await self._grader.grade(program, self.row["tests"]))["correct"])
        except Exception as e:  # infrastructure (the sandbox failed): typed, never scored 0
            raise RewardError(f"code: grading the submission failed: {type(e).__name__}({e})") from e
        return StepResult(reward=correct, reward_parts={"correct": correct}, done=True, metrics=self._final_metrics(True))

    @property
    def _grader(self) -> CodeReward:
        key = json.dumps([self.sandbox.model_dump(), self.grade_limits], sort_keys=True, default=str)
        if key not in _GRADERS:
            _GRADERS[key] = CodeReward(self.sandbox, limits=self.grade_limits or None)
        return _GRADERS[key]

