"""The sandboxed code reward: passing programs score 1, every failure of the code 0, an
early exit never passes, and the reward contract awaits it like any reward function.
The attacks on it are in tests/test_reward_hacking.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from sandbox_support import require_bwrap, wait_for_no_sandbox_processes

from tidal.rewards import call_reward, call_reward_async
from tidal.rewards.code import CodeReward, extract_program, score
from tidal.sandbox import SandboxConfig, SandboxUnavailable

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
COMPLETIONS = {
    "fenced, correct": ("I will add them.\n```python\ndef add(a, b):\n    return a + b\n```\nDone.", 1.0),
    "bare, correct": ("def add(a, b):\n    return a + b\n", 1.0),
    "wrong": ("```python\ndef add(a, b):\n    return a - b\n```", 0.0),
    "raises": ("```python\ndef add(a, b):\n    raise ValueError\n```", 0.0),
    "exits 0 before the tests": ("```python\nimport sys\nsys.exit(0)\n```", 0.0),
    "os._exit(0) before the tests": ("```python\nimport os\nos._exit(0)\n```", 0.0),
    "prints a token of its own": ("```python\nprint('0' * 32)\nimport os\nos._exit(0)\n```", 0.0),
    # Correct only if it could find the tests: in stdin or in the grader's file.
    "looks for the tests": (("```python\nimport sys\nseen = sys.stdin.read()\ntry:\n"
                             "    seen += open('/workspace/main.py').read()\nexcept OSError:\n    pass\n"
                             "if 'assert add' in seen:\n    def add(a, b):\n        return a + b\n```"), 0.0),
    "loops": ("```python\nwhile True:\n    pass\n```", 0.0),
}


@pytest.fixture
def bwrap():
    require_bwrap()


def test_extract_program_takes_the_last_python_block():
    assert extract_program("a\n```python\nx = 1\n```\nb\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_program("x = 3") == "x = 3"


def test_code_reward_scores_the_program_and_only_the_program(bwrap):
    reward = CodeReward(SandboxConfig(warm=2), limits={"cpu_s": 1, "wall_s": 3})

    async def go():
        try:
            return await asyncio.gather(*(reward(completion, TESTS) for completion, _ in COMPLETIONS.values()))
        finally:
            await reward.close()

    got = {name: out["correct"] for name, out in zip(COMPLETIONS, asyncio.run(go()))}
    assert got == {name: expected for name, (_, expected) in COMPLETIONS.items()}
    assert wait_for_no_sandbox_processes() == []


def test_the_reward_contract_awaits_the_sandboxed_reward(bwrap):
    row = {"prompt": "Write add(a, b).", "tests": TESTS, "task_id": "add"}

    async def go():
        try:
            return await call_reward_async(score, COMPLETIONS["fenced, correct"][0], row)
        finally:
            await score.close()

    assert asyncio.run(go()) == (1.0, {"correct": 1.0})
    with pytest.raises(TypeError, match="call_reward_async"):
        call_reward(score, "x", row)  # an async reward cannot be called synchronously by mistake


def test_a_loop_per_step_leaves_no_pool_behind(bwrap):
    """A run may make an event loop per step: each loop's pool (its starter threads and
    warm sandboxes) ends with the loop."""
    reward = CodeReward(SandboxConfig(warm=2))
    threads = threading.active_count()
    for _ in range(3):
        assert asyncio.run(reward(COMPLETIONS["bare, correct"][0], TESTS)) == {"correct": 1.0}
    assert reward._pools == {}
    assert wait_for_no_sandbox_processes() == []
    deadline = time.monotonic() + 5.0  # executor threads leave once they see the shutdown
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads


def test_a_sandbox_that_cannot_run_raises_instead_of_scoring_zero():
    reward = CodeReward(SandboxConfig(bwrap="/nonexistent/bwrap", warm=0))
    with pytest.raises(SandboxUnavailable):
        asyncio.run(reward("def add(a, b): return a + b", TESTS))
