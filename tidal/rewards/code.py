"""Reward for generated code: run the completion's program against unit tests in the sandbox.

    tidal train my_code_task.yaml task.reward=tidal.rewards.code:score

The dataset has a `tests` column: Python that exercises the program (asserts, calls).
The program is the last fenced ```python block of the completion (or the whole
completion when it has none), the module `solution` in the workspace. A harness reads a
per-run token and the tests from stdin and deletes its own file (so the program finds
neither on disk or in stdin), imports `solution`, runs the tests in its namespace, and
prints the token. Only a run that prints the token last, exits 0 and stays within its
limits is correct: a program that exits early (`sys.exit(0)`, `os._exit(0)`) or reads the
tests to hard-code answers fails. It can still reach the harness's locals by frame
introspection within its own process; this guards against the easy hacks, it is no proof.

`score` is async: the episodes' runs overlap, bounded by one sandbox pool per event loop.
A sandbox failure raises (the episode ends `reward_error`, never scored 0).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import weakref

from tidal.sandbox import SandboxConfig, SandboxPool, SandboxStatus

FENCE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
HARNESS = """import os, sys
def _main():
    token = sys.stdin.readline().strip()
    tests = sys.stdin.read()
    os.remove(__file__)
    import solution
    namespace = {name: value for name, value in vars(solution).items() if not name.startswith("__")}
    exec(compile(tests, "tests.py", "exec"), {**namespace, "__name__": "tests"})
    print(token)
_main()
"""
DEFAULT_LIMITS = {"wall_s": 10.0, "cpu_s": 5}



def extract_program(completion: str) -> str:
    """The last fenced Python block of the completion, or all of it when there is none."""
    blocks = FENCE_RE.findall(completion)
    return blocks[-1] if blocks else completion


class CodeReward:
    """`await reward(completion, tests)` -> {"correct": 0 or 1}. One sandbox pool per event
    loop (a pool belongs to one loop), created on first use from `config`."""

    def __init__(self, config: SandboxConfig | None = None, limits: dict | None = None):
        self.config = config or SandboxConfig()
        self.limits = {**DEFAULT_LIMITS, **(limits or {})}
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SandboxPool] = weakref.WeakKeyDictionary()

    def pool(self) -> SandboxPool:
        loop = asyncio.get_running_loop()
        if loop not in self._pools:
            self._pools[loop] = SandboxPool(self.config)
        return self._pools[loop]

    async def close(self) -> None:
        """Close this loop's pool (its warm sandboxes); a later call makes a new one."""
        pool = self._pools.pop(asyncio.get_running_loop(), None)
        if pool is not None:
            await pool.close()

    async def __call__(self, completion: str, tests: str) -> dict[str, float]:
        """correct: 1 when the program passes `tests` in the sandbox; 0 for any failure of
        the code (wrong answer, exception, timeout, memory, output flood, early exit)."""
        token = secrets.token_hex(16)
        result = await self.pool().run_python(
            HARNESS, files={"solution.py": extract_program(completion)}, stdin=f"{token}\n{tests}", limits=self.limits)
        if result.status is SandboxStatus.SANDBOX_ERROR:
            raise RuntimeError(f"sandbox failed to run the tests: {result.error}")
        passed = result.ok and result.stdout.rstrip("\n").rsplit("\n", 1)[-1] == token
        return {"correct": float(passed)}


# `task.reward=tidal.rewards.code:score`. No warm sandboxes: nothing outlives a run's
# event loop. For throughput, name your own `CodeReward(SandboxConfig(warm=8, ...))`.
score = CodeReward(SandboxConfig(warm=0))
