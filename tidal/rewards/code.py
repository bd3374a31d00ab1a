"""Reward for generated code: unit tests run against the program in a fresh sandbox.

    tidal train my_code_task.yaml task.reward=tidal.rewards.code:score

The dataset has a `tests` column: Python that exercises the program (asserts, calls,
`check(candidate)`). The program is the last fenced ```python block of the completion (or
the whole completion when it has none), the module `solution`. `CodeReward.grade(program,
tests)` grades a program text directly: the code environment calls it at an episode's end
with the dataset's original tests, so whatever the policy did to test files in its own
workspace changes nothing.

The choice: the tests and the program run in two processes, and only the tests' process
can vouch for a pass. Each grading is a new sandbox (bubblewrap, no network, rlimits)
holding two interpreters. The grader reads a per-run token and the tests from stdin,
empties stdin, makes itself non-dumpable (the program, the same uid, can then neither
read its memory or /proc files nor ptrace it), and only then has a fresh interpreter
(exec'd meanwhile, sharing no memory with it) import the program. The tests run in the grader; every use of a program name is a
message to the program's process, which sees its call's arguments and nothing else, and
returns plain values by copy (an object that claims to equal everything stays in its own
process, where no test compares with it). The grader prints the token with its verdict
once every test ran and the program's process still answers. So none of these pass:
exiting early (`sys.exit(0)`, `os._exit(0)`), patching the test runner (`builtins`,
`sys.exit`, `unittest`, `print`, trace functions), swallowing exceptions globally,
reading the tests or the token (stdin, /proc/self/fd, the parent's /proc, environment
variables, files, frames, `gc`), editing or deleting test files, shadowing modules the
grader imports. `tests/test_reward_hacking.py` runs each of these; docs/rewards.md has the
threat model and what it does not cover.

`score` is async: the episodes' gradings overlap, bounded by one sandbox pool per event
loop. A failure of the sandbox or of the grading machinery itself raises (the episode
ends `reward_error`, never scored 0).
"""

from __future__ import annotations

import asyncio
import functools
import re
import secrets
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.rewards._code_grader import COMPILED_NAME, PARTS
from tidal.rewards.contract import RewardParts
from tidal.sandbox import SandboxConfig, SandboxPool, SandboxResult, SandboxStatus, SandboxUnavailable
from tidal.sandbox.launch import resolve_python

FENCE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
GRADER_SOURCE = "\n\n".join(Path(__file__).with_name(part).read_text() for part in PARTS)  # one script
# The sandbox's main script: it runs the grader compiled by the host (the sandbox's
# interpreter compiles it once per process: each grading would spend two compiles on it).
GRADER_MAIN = ("import marshal\n"
               f"with open({COMPILED_NAME!r}, 'rb') as f:\n"
               "    exec(marshal.loads(f.read()))\n")
PROGRAM_MODULE = "solution"
# Two interpreters share these: each process gets cpu_s and memory_bytes of its own.
DEFAULT_LIMITS = {"wall_s": 10.0, "cpu_s": 5}


@functools.lru_cache(maxsize=8)
def compiled_grader(executable: str) -> bytes:
    """The grader's code object, compiled and marshalled by `executable` (the sandbox's
    interpreter: marshal's format is that of one Python version)."""
    script = ("import marshal,sys\nsys.stdout.buffer.write(marshal.dumps(compile(sys.stdin.read(),"
              "'<tidal-code-grader>','exec')))")
    out = subprocess.run([executable, "-I", "-S", "-c", script], input=GRADER_SOURCE.encode(), capture_output=True,
                         timeout=60, check=False)
    if out.returncode != 0:
        raise SandboxUnavailable(f"the sandbox interpreter {executable} cannot compile the code grader: "
                                 f"{out.stderr.decode(errors='replace').strip()[-500:]}")
    return out.stdout


def extract_program(completion: str) -> str:
    """The last fenced Python block of the completion, or all of it when there is none."""
    blocks = FENCE_RE.findall(completion)
    return blocks[-1] if blocks else completion


@dataclass(frozen=True)
class CodeVerdict:
    """The outcome of one grading: whether it passed, why not, and the sandbox's result."""

    passed: bool
    reason: str  # "passed", or what failed (the grader's words, or the sandbox's status)
    result: SandboxResult


class CodeReward:
    """`await reward(completion, tests)` -> {"correct": 0 or 1}; `await reward.grade(program,
    tests)` for a program text. One sandbox pool per event loop (a pool belongs to one
    loop), created on first use from `config`; `limits` override the sandbox's per run."""

    def __init__(self, config: SandboxConfig | Mapping | None = None, limits: Mapping | None = None):
        # A mapping is what `task.rewards[].args` gives from YAML.
        self.config = SandboxConfig.model_validate(config) if isinstance(config, Mapping) else config or SandboxConfig()
        self.limits = {**DEFAULT_LIMITS, **(limits or {})}
        self._grader_code: bytes | None = None
        # Not weak: a pool's semaphore refers to its loop once contended, so a weak key would
        # never go; the pool's lifetime generator removes the entry instead.
        self._pools: dict[asyncio.AbstractEventLoop, tuple[SandboxPool, Any]] = {}

    async def pool(self) -> SandboxPool:
        """This event loop's pool, made on first use and closed when the loop shuts down
        its async generators (asyncio.run does, before closing the loop): a run that makes
        a loop per step keeps no pool, thread or warm sandbox of a finished step."""
        loop = asyncio.get_running_loop()
        if loop not in self._pools:
            pool = SandboxPool(self.config)
            lifetime = self._lifetime(loop, pool)
            self._pools[loop] = (pool, lifetime)
            await lifetime.__anext__()  # first iterated in this loop: the loop finalizes it
        return self._pools[loop][0]

    async def _lifetime(self, loop: asyncio.AbstractEventLoop, pool: SandboxPool):
        try:
            yield
        finally:
            if self._pools.get(loop, (None,))[0] is pool:
                del self._pools[loop]
            await pool.close()

    async def close(self) -> None:
        """Close this loop's pool (its warm sandboxes) now; a later call makes a new one."""
        entry = self._pools.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[1].aclose()

    async def __call__(self, completion: str, tests: str) -> RewardParts:
        """correct: 1 when the completion's program passes `tests`; 0 for any failure of the
        code (wrong answer, exception, timeout, memory, output flood, early exit, tampering)."""
        return await self.grade(extract_program(completion), tests)

    async def grade(self, program: str, tests: str, files: Mapping[str, str | bytes] | None = None) -> RewardParts:
        """Grade `program` (the source of module `solution`, with `files` beside it in the
        workspace) against `tests` in a fresh sandbox: {"correct": 0 or 1}, with the metrics
        `code/program_exited` (it exited or crashed before the tests ended) and `code/timeout`
        (the wall clock, or the program's CPU time limit)."""
        verdict = await self.verdict(program, tests, files)
        return RewardParts({"correct": float(verdict.passed)}, {
            "code/program_exited": float("ProgramExited" in verdict.reason),
            "code/timeout": float(verdict.result.status is SandboxStatus.TIMEOUT or "CPU time limit" in verdict.reason)})

    async def verdict(self, program: str, tests: str, files: Mapping[str, str | bytes] | None = None) -> CodeVerdict:
        """`grade` with the reason: what failed, and the sandbox's result (stdout, stderr)."""
        if not isinstance(program, str) or not isinstance(tests, str):
            raise TypeError(f"CodeReward grades a program and tests given as str, got {type(program).__name__} "
                            f"and {type(tests).__name__}")
        if not tests.strip():
            raise ValueError("CodeReward: the tests are empty, so every program would pass (check the `tests` column)")
        workspace = dict(files or {})
        for reserved in ("main.py", COMPILED_NAME):
            if reserved in workspace:
                raise ValueError(f"CodeReward: the workspace file `{reserved}` is the grader's; rename the program's file")
        workspace[f"{PROGRAM_MODULE}.py"] = program
        if self._grader_code is None:  # once: a subprocess of the sandbox's interpreter, off the loop
            executable = resolve_python(self.config).executable
            self._grader_code = await asyncio.to_thread(compiled_grader, executable)
        workspace[COMPILED_NAME] = self._grader_code
        token = secrets.token_hex(16)
        payload = f"{token}\n{PROGRAM_MODULE}\n{tests}".encode("utf-8", "surrogatepass")
        result = await (await self.pool()).run_python(GRADER_MAIN, files=workspace, stdin=payload, limits=self.limits)
        if result.status is SandboxStatus.SANDBOX_ERROR:
            raise RuntimeError(f"the sandbox failed to run the tests: {result.error}")
        # Only the grader knows the token, so only it can write a line that starts with it.
        lines = [line for line in result.stdout.splitlines() if line.startswith(token)]
        verdict = lines[-1][len(token) + 1:] if lines else ""
        if verdict.startswith("error:"):
            raise RuntimeError(f"the code grader could not start: {verdict[len('error:'):].strip()}; "
                               f"stderr: {result.stderr.strip()[-1000:]}")
        last_line = result.stdout.rstrip("\n").rsplit("\n", 1)[-1]
        if result.ok and verdict == "pass" and last_line == f"{token} pass":
            return CodeVerdict(True, "passed", result)
        if verdict.startswith("fail:"):
            return CodeVerdict(False, verdict[len("fail:"):].strip(), result)
        return CodeVerdict(False, f"the grader did not finish: {result}", result)


# `task.reward=tidal.rewards.code:score`. No warm sandboxes: nothing outlives a run's
# event loop. For throughput, name your own `CodeReward(SandboxConfig(warm=8, ...))`.
score = CodeReward(SandboxConfig(warm=0))
