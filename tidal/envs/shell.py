"""shell (computer use): reach a goal state in a sandboxed workspace through shell commands.

The policy sees a task in words (tidal.envs.shell_tasks: create, move, find, edit, fix a
script, count, delete, copy, sort, chmod) and works in the task's starting workspace through
one persistent bash (tidal.sandbox `ShellSession`: the current directory, variables and
functions last across turns), with two tools in the Hermes format
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`:

- `bash(command)` runs a command line (`ls`, `cat`, `mkdir`, `mv`, `grep`, `sed`, `python`, …;
  several lines allowed) and answers with its stdout and stderr, `[exit code N]` when it failed,
  truncated to `max_tool_output_chars`;
- `done()` ends the episode. A turn without a tool call ends it too, and so does the env's own
  turn limit (`max_turns`).

The verifier runs once, after the episode's last turn. It reads the final workspace out of
the session as a tar, then runs `shell_tasks.CHECKER` on it in a fresh sandbox, with the
checks (and any hidden inputs) on stdin; the policy never sees them or their output. Nothing
the policy did to its shell (functions named like commands, even `/usr/bin/env`, PATH,
variables) reaches the checker: at most it could fake the tar, which means writing out a
workspace that meets the goal. Reward 1 only when every check passes (the last step's per-turn
reward, `{"correct": 0 or 1}`; `default_reward` is None). A command that runs past
`command_timeout_s` or floods its output kills the session, and the workspace dies with it:
the episode ends with reward 0 (the policy's doing), as it does when the workspace cannot be
read back (more than the session's output cap, 1 MiB by default, once tarred). A sandbox that
cannot start or run is an infrastructure failure: `env_error` (or `reward_error` at the
check), never 0.

Per-turn metrics: `shell/commands`, `shell/command_errors` (non-zero exit or killed),
`shell/timeouts`; at the end `shell/checks_passed` (the fraction of checks met),
`shell/workspace_lost`, `shell/verifier_failed` (the workspace could not be read back) and
`shell/out_of_turns` (the env's `max_turns` ended it).

Reproducibility: the starting files are written with a fixed modification time, bash's
`$RANDOM` is seeded from the episode seed and `PYTHONHASHSEED` is 0, so the same seed and the
same commands give the same observations (up to what the commands themselves make of the
clock, e.g. `date` or the times of files they create).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import secrets
from typing import Any, ClassVar

from tidal.envs.base import Action, Message, RewardError, StepResult
from tidal.envs.code import loop_pool, sandbox_config
from tidal.envs.shell_tasks import CHECKER, FAMILIES, make_tasks
from tidal.envs.tool_env import ToolEnv
from tidal.envs.tools import Tool
from tidal.sandbox import SandboxConfig, SandboxPool, SandboxStatus, ShellSession
from tidal.sandbox.launch import resolve_python
from tidal.sandbox.session import ansi_c_quote

TASK_DIR = "task"  # the shell starts here, inside the sandbox's workspace
FILE_TIME = 1_700_000_000  # the starting files' mtime (2023-11-14): `ls -l` shows the same every run
SYSTEM_PROMPT = (
    "You work in a Linux shell, in the task's workspace directory. Run a command with\n"
    '<tool_call>{"name": "bash", "arguments": {"command": "ls -R"}}</tool_call>\n'
    "and read its output; the shell keeps its current directory and variables between commands. "
    'When the task is done, call <tool_call>{"name": "done", "arguments": {}}</tool_call> '
    "(or answer without a tool call). The final state of the files is checked."
)


def _validate_row(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    where = f"shell: row {row.get('task_id', '?')}"
    files, checks = row.get("files"), row.get("checks")
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("path"), str)
                                              and isinstance(f.get("content", ""), str) for f in files):
        raise ValueError(f"{where}: `files` must be a list of {{path, content, executable}} objects, got {files!r:.200}")
    try:
        parsed = json.loads(checks) if isinstance(checks, str) else checks
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: `checks` is not JSON: {e}") from None
    if not isinstance(parsed, list) or not parsed or not all(isinstance(c, dict) and "kind" in c for c in parsed):
        raise ValueError(f"{where}: `checks` must be a non-empty JSON list of checks with a `kind`, got {checks!r:.200}")
    return files, parsed


class ShellEnv(ToolEnv):
    """`ShellEnv(row, seed, **env_args)`: one task of tidal.envs.shell_tasks in a sandboxed bash.

    env_args: `max_turns` (after this many turns the env verifies and ends the episode; keep
    rollout.max_turns at least this), `command_timeout_s`, `max_tool_output_chars`,
    `max_calls_per_turn`, `system_prompt`, `sandbox` (SandboxConfig fields), `verify_timeout_s`,
    `families` (task families of `rows`). `pool` (a SandboxPool, not from YAML) shares one pool.
    """

    name: ClassVar[str] = "shell"
    default_system_prompt: ClassVar[str] = SYSTEM_PROMPT
    default_reward: ClassVar[str | None] = None  # the verifier's reward is the last step's

    @classmethod
    def rows(cls, split: str, n: int, seed: int, families: list[str] | None = None,
             **env_args: Any) -> list[dict[str, Any]]:
        """`n` distinct generated tasks of `split` ("train" or "test"), families in turn."""
        return make_tasks(split, n, seed, families)

    def __init__(self, row: dict[str, Any], seed: int = 0, *, max_turns: int = 10, command_timeout_s: float = 10.0,
                 max_tool_output_chars: int = 1500, max_calls_per_turn: int = 4, system_prompt: str | None = None,
                 sandbox: dict[str, Any] | SandboxConfig | None = None, verify_timeout_s: float = 30.0,
                 families: list[str] | None = None, pool: SandboxPool | None = None):
        self.files, self.checks = _validate_row(row)
        if max_turns < 1 or command_timeout_s <= 0 or verify_timeout_s <= 0:
            raise ValueError(f"shell: env_args.max_turns ({max_turns}) must be >= 1, command_timeout_s "
                             f"({command_timeout_s}) and verify_timeout_s ({verify_timeout_s}) > 0")
        unknown = [f for f in families or [] if f not in FAMILIES]
        if unknown:
            raise ValueError(f"shell: env_args.families has unknown families {unknown} (families: {', '.join(FAMILIES)})")
        tools = [Tool.from_function(self._bash, name="bash"), Tool.from_function(self._done, name="done")]
        # Commands of one turn share the shell one at a time, so the last may wait for the others:
        # the tool timeout covers them all, and the session's own wall clock always comes first.
        super().__init__(row, seed, tools=tools, system_prompt=system_prompt,
                         tool_timeout_s=command_timeout_s * max_calls_per_turn + 30.0,
                         max_tool_output_chars=max_tool_output_chars, max_calls_per_turn=max_calls_per_turn)
        self.max_turns = max_turns
        self.command_timeout_s = command_timeout_s
        self.verify_timeout_s = verify_timeout_s
        self.sandbox = sandbox_config(sandbox, "shell")
        self._pool = pool
        self._session: ShellSession | None = None
        self._python = ""  # the sandbox's interpreter (an absolute path)
        self._workspace = ""
        self._lock = asyncio.Lock()
        self._finished = False
        self._lost = ""  # why the workspace is gone, if it is
        self._infra_error = ""
        self._metrics: dict[str, float] = {}

    async def reset(self) -> list[Message]:
        await self._close_session()
        self._finished, self._lost, self._infra_error = False, "", ""
        pool = self._pool or await loop_pool(self.sandbox)
        self._python = resolve_python(pool.config).executable
        # The task's files live one level down, in `task/`, so that `..` (the sandbox's own
        # workspace, unlike its read-only root) can get a fixed time too.
        files = {f"{TASK_DIR}/{f['path']}": f.get("content", "").encode() for f in self.files}
        self._session = await pool.shell_session(files=files, limits={"wall_s": self.command_timeout_s})
        executables = " ".join(ansi_c_quote(f["path"]) for f in self.files if f.get("executable"))
        py = ansi_c_quote(self._python)
        setup = (f"mkdir -p {TASK_DIR} && cd {TASK_DIR} && export HOME=\"$PWD\"; umask 022; RANDOM={self.seed % 32768}; export PYTHONHASHSEED=0; "
                 f'python() {{ {py} "$@"; }}; python3() {{ {py} "$@"; }}; export -f python python3; '
                 + (f"chmod +x {executables}; " if executables else "")
                 + f"find .. -exec touch -h -d @{FILE_TIME} {{}} + && printf %s \"$PWD\"")
        result = await self._session.run(setup, wall_s=30.0)
        if not result.ok or not result.stdout.startswith("/"):
            await self._close_session()
            raise RuntimeError(f"shell: setting up the workspace of task {self.row.get('task_id', '?')} failed: "
                               f"{result} {result.error or result.stderr.strip()[-500:]}")
        self._workspace = result.stdout
        return await super().reset()

    # -- tools ------------------------------------------------------------------------------
    async def _bash(self, command: str) -> str:
        """Run a bash command line in the workspace's shell and show its output.

        Args:
            command: the command line, e.g. `ls -la` or `grep -rn word docs`
        """
        async with self._lock:
            if self._lost or self._session is None:
                return "error: the shell has ended"
            self._count("shell/commands")
            result = await self._session.run(command, wall_s=self.command_timeout_s)
            if result.status is SandboxStatus.SANDBOX_ERROR:
                self._infra_error = f"the sandbox could not run a command: {result.error}"
                raise RuntimeError("the sandbox failed (infrastructure); the episode ends")
            out = result.stdout + result.stderr
            if not result.ok:
                self._count("shell/command_errors")
            if result.status is SandboxStatus.TIMEOUT:
                self._count("shell/timeouts")
            if self._session.ended is not None:
                why = (f"it ran past {self.command_timeout_s:g} s" if result.status is SandboxStatus.TIMEOUT
                       else "it wrote too much output" if result.status is SandboxStatus.OUTPUT_LIMIT
                       else "the shell exited")
                self._lost = why
                return out + f"\n[killed: {why}; the shell and its workspace are gone, the episode ends]"
            if result.status is not SandboxStatus.OK:
                out += f"\n[{result.status.value}]"
            elif result.exit_code != 0:
                out += ("" if not out or out.endswith("\n") else "\n") + f"[exit code {result.exit_code}]"
            return out if out.strip() else "(no output)"

    async def _done(self) -> str:
        """Say that the task is done: the episode ends and the workspace is checked."""
        self._finished = True
        return "ok"

    def _count(self, key: str) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + 1.0

    # -- turns ------------------------------------------------------------------------------
    async def step(self, action: Action | str) -> StepResult:
        turn = self.turn
        self._metrics = {"shell/commands": 0.0, "shell/command_errors": 0.0, "shell/timeouts": 0.0}
        result = await super().step(action)
        if self._infra_error:
            raise RuntimeError(f"shell: {self._infra_error}")
        result.metrics = {**result.metrics, **self._metrics}
        if result.done:  # a turn without tool calls: final_turn verified
            return result
        if not (self._lost or self._finished or turn + 1 >= self.max_turns):
            return result
        final = await self._verify()
        final.tool_calls, final.assistant_message = result.tool_calls, result.assistant_message
        final.metrics = {**result.metrics, **final.metrics,
                         "shell/out_of_turns": float(not self._finished and not self._lost)}
        return final

    async def final_turn(self, action: Action) -> StepResult:
        return await self._verify()

    async def _verify(self) -> StepResult:
        """Read the final workspace out of the session (a tar), then run the checker on it in a
        fresh sandbox; reward 1 when every check passes."""
        if self._lost or self._session is None or self._session.ended is not None:
            return self._result(0, "workspace_lost")
        snapshot = f"/usr/bin/tar -C {ansi_c_quote(self._workspace)} -cf - . | /usr/bin/base64 -w0"
        async with self._lock:
            result = await self._session.run(snapshot, wall_s=self.verify_timeout_s)
        if result.status is SandboxStatus.SANDBOX_ERROR:
            raise RewardError(f"shell: the sandbox could not read the workspace of task "
                              f"{self.row.get('task_id', '?')}: {result.error}")
        try:
            tar = base64.b64decode(result.stdout, validate=True) if result.ok else b""
        except binascii.Error:
            tar = b""
        if not tar:  # the policy broke what the snapshot needs (a flood of output, a huge workspace, …)
            return self._result(0, "verifier_failed")
        token = secrets.token_hex(16)
        spec = json.dumps({"token": token, "checks": self.checks, "workspace": self._workspace})
        pool = self._pool or await loop_pool(self.sandbox)
        checked = await pool.run_python(CHECKER, files={"snapshot.tar": tar}, stdin=spec,
                                        limits={"wall_s": self.verify_timeout_s, "cpu_s": int(self.verify_timeout_s) + 1})
        if checked.status is SandboxStatus.SANDBOX_ERROR:
            raise RewardError(f"shell: the sandbox could not run the verifier of task {self.row.get('task_id', '?')}: "
                              f"{checked.error}")
        lines = [line for line in checked.stdout.splitlines() if line.startswith(token + " ")]
        if not checked.ok or not lines:
            return self._result(0, "verifier_failed")
        counts = json.loads(lines[-1][len(token) + 1:])
        return self._result(counts["passed"] / max(counts["total"], 1))

    @staticmethod
    def _result(passed: float, why: str = "") -> StepResult:
        correct = float(passed == 1.0)
        metrics = {"shell/checks_passed": float(passed), "shell/workspace_lost": float(why == "workspace_lost"),
                   "shell/verifier_failed": float(why == "verifier_failed"), "shell/out_of_turns": 0.0}
        return StepResult(reward=correct, reward_parts={"correct": correct}, done=True, metrics=metrics)

