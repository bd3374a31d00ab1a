"""The `shell` environment: generated tasks and splits, the persistent bash, the verifier on
the final workspace (and what cannot fool it), and the real rollout driven by a scripted
policy (tidal.engines.scripted) to reward 1 and to reward 0."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from sandbox_support import require_bwrap

from tidal.engines.scripted import ScriptedEngine
from tidal.envs.base import Action
from tidal.envs.shell import ShellEnv
from tidal.envs.shell_tasks import FAMILIES, make_task, make_tasks
from tidal.models import load_tokenizer
from tidal.runtime.rollout import EpisodeSpec, Rollout
from tidal.types import SamplingParams, Status

ASSETS = "tidal/models/assets/tiny-arith"


@pytest.fixture(autouse=True)
def _bwrap():
    require_bwrap()


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def bash(*commands: str) -> str:
    return "".join(call("bash", command=c) for c in commands)


def family_task(family: str, seed: int = 0) -> dict:
    return next(r for r in make_tasks("train", 40, seed) if r["family"] == family)


async def _drive(env: ShellEnv, turns: list[str]) -> list:
    """reset, then each turn as an Action: every observation (the opening messages, each
    step's messages, reward, done)."""
    seen = [await env.reset()]
    try:
        for i, text in enumerate(turns):
            out = await env.step(Action(text, turn=i))
            seen.append((out.messages, out.reward, out.done))
            if out.done:
                break
    finally:
        await env.close()
    return seen


def test_splits_never_overlap_and_every_family_is_in_both():
    train, test = make_tasks("train", 400, 0), make_tasks("test", 100, 0)
    assert len(FAMILIES) >= 6
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in make_tasks("test", 300, 5)}
    assert set(Counter(r["family"] for r in test)) == set(FAMILIES) == set(Counter(r["family"] for r in train))
    assert len({r["task_id"] for r in train}) == 400  # distinct
    assert make_tasks("train", 20, 3) == make_tasks("train", 20, 3)  # a function of the seed
    assert [r["task_id"] for r in make_tasks("train", 20, 4)] != [r["task_id"] for r in make_tasks("train", 20, 3)]
    with pytest.raises(ValueError, match="unknown task families"):
        make_tasks("train", 5, 0, families=["create_file", "launch_rockets"])
    with pytest.raises(ValueError, match="families"):
        ShellEnv(train[0], families=["nope"])


def test_a_bad_row_is_named():
    row = dict(family_task("create_file"), task_id="shell-bad", checks="not json")
    with pytest.raises(ValueError, match="shell-bad.*checks"):
        ShellEnv(row)


def test_every_family_reference_reaches_the_goal_and_doing_nothing_does_not():
    """One task per family: its reference commands, then done → 1; answering at once → 0
    (the starting workspace never meets the goal)."""
    import random

    rows = [make_task(f, random.Random(f"family-{f}")) for f in FAMILIES]

    async def go():
        solved = [_drive(ShellEnv(r, 1), [bash(*r["solution"]), call("done")]) for r in rows]
        idle = [_drive(ShellEnv(r, 1), ["Nothing to do."]) for r in rows]
        return await asyncio.gather(*solved), await asyncio.gather(*idle)

    solved, idle = asyncio.run(go())
    assert {r["family"]: s[-1][1] for r, s in zip(rows, solved)} == {f: 1.0 for f in FAMILIES}
    assert {r["family"]: s[-1][1] for r, s in zip(rows, idle)} == {f: 0.0 for f in FAMILIES}


def test_fix_script_is_checked_on_hidden_input():
    """Hard-coding the expected output for the given data file passes that run but not the
    run on the checker's hidden file."""
    row = family_task("fix_script")
    script, data = row["files"][0]["path"], row["files"][1]["path"]
    expected = json.loads(row["checks"])[0]["stdout"]
    cheat = f"printf 'print(%s)\\n' {json.dumps(json.dumps(expected))} > {script}"
    seen = asyncio.run(_drive(ShellEnv(row, 0), [bash(cheat, f"python {script} {data}"), call("done")]))
    assert seen[1][0][1]["content"].strip() == expected  # it does print the right answer for data
    assert seen[-1][1] == 0.0


def test_shell_state_persists_and_same_actions_give_same_observations():
    row = family_task("move_files")
    turns = [bash("ls -la; ls -laR .. | head -5", "mkdir -p sub && cd sub && export V=7"),
             bash("pwd; echo $V $RANDOM; python -c 'print(hash(\"abc\"))'", "cat nope.txt"),
             bash("cd .. && find . -type f | sort"),
             "I stop here."]
    first = asyncio.run(_drive(ShellEnv(row, 42), turns))
    second = asyncio.run(_drive(ShellEnv(row, 42), turns))
    assert first == second
    listing, state, errors = first[1][0][0]["content"], first[2][0][0]["content"], first[2][0][1]["content"]
    assert "Nov 14  2023" in listing and row["files"][0]["path"].split("/")[0] in listing
    assert state.splitlines()[0].endswith("/task/sub") and state.splitlines()[1].startswith("7 ")
    assert "No such file" in errors and errors.rstrip().endswith("[exit code 1]")
    assert first[-1][1:] == (0.0, True)
    other_seed = asyncio.run(_drive(ShellEnv(row, 43), turns))
    assert other_seed[2][0][0]["content"] != state  # $RANDOM follows the episode seed


def test_the_verifier_is_not_fooled_by_the_shell():
    """Functions (even one named `/usr/bin/env`), PATH and variables the policy sets up in its
    shell do not stand in for the checker, which runs in a fresh sandbox on a snapshot of the
    workspace, and do not stop it."""
    row = family_task("create_file")
    # Each stand-in answers like the checker would on success: its last argument (the token), then all passed.
    forge = 'echo "${@: -1}" \'{"passed": 1, "total": 1}\''
    tamper = bash(f"mkdir -p fake && printf '#!/bin/bash\\n%s\\n' {json.dumps(forge)} > fake/env && chmod +x fake/env "
                  "&& export PATH=$PWD/fake:$PATH PYTHONSTARTUP=/nonexistent LD_PRELOAD=/nonexistent",
                  f"python3() {{ {forge}; }}; python() {{ {forge}; }}; env() {{ {forge}; }}; export -f env; "
                  f"/usr/bin/env() {{ {forge}; }}")
    seen = asyncio.run(_drive(ShellEnv(row, 0), [tamper, call("done")]))
    assert seen[-1][1] == 0.0
    seen = asyncio.run(_drive(ShellEnv(row, 0), [tamper, bash(*row["solution"]) + call("done")]))
    assert seen[-1][1] == 1.0


def test_a_command_past_its_timeout_loses_the_workspace_and_ends_with_zero():
    row = family_task("create_file")
    env = ShellEnv(row, 0, command_timeout_s=1.0)
    seen = asyncio.run(_drive(env, [bash(*row["solution"]) + bash("sleep 30"), call("done")]))
    assert len(seen) == 2 and seen[-1][1:] == (0.0, True)
    assert env.closed and env._session is None


def test_the_env_verifies_at_its_own_turn_limit():
    row = family_task("copy_backup")
    seen = asyncio.run(_drive(ShellEnv(row, 0, max_turns=2), [bash("ls"), bash(*row["solution"]), call("done")]))
    assert len(seen) == 3 and seen[-1][1:] == (1.0, True)


# -- the real rollout, a scripted policy ----------------------------------------------------

def test_rollout_reaches_the_goal_for_1_and_not_for_0():
    tok = load_tokenizer(ASSETS)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    row = family_task("find_word")
    root = row["solution"][0].split()[-3]
    secret = row["solution"][0].split()[2]
    good = [bash(f"ls -R {root}"), bash(f"grep -rlw {secret} {root}"), bash(*row["solution"]), call("done")]
    bad = [bash(f"ls -R {root}"), bash(f"ls {root} | head -1 > answer.txt"), "Done."]
    rollout = Rollout(tok, SamplingParams(max_new_tokens=512, stop_token_ids=(eos,)), max_turns=10, timeout_s=60.0)

    async def go():
        specs, engines, envs = [], [], []
        for i, script in enumerate([good, bad]):
            envs.append(ShellEnv(row, 5))
            engines.append(ScriptedEngine.from_texts(tok, script, stop_token_id=eos))
            specs.append(EpisodeSpec(envs[-1], f"e{i}", "g", row["task_id"], 5, row=row))
        out = [(await rollout.run([s], e, step=0))[0] for s, e in zip(specs, engines)]
        return out, envs

    (ep_good, ep_bad), envs = asyncio.run(go())
    assert (ep_good.status, ep_bad.status) == (Status.OK, Status.OK), (ep_good.error, ep_bad.error)
    assert (ep_good.reward, ep_bad.reward) == (1.0, 0.0)
    assert ep_good.turns[-1].reward == 1.0 and sum(t.reward for t in ep_good.turns[:-1]) == 0.0
    assert ep_good.metrics["shell/commands"] == 3.0 and ep_good.metrics["shell/checks_passed"] == 1.0
    assert [c.name for t in ep_good.turns for c in t.tool_calls] == ["bash", "bash", "bash", "done"]
    # The grep's output (the file's path) reached the policy as masked observation tokens.
    t1 = ep_good.turns[1]
    assert json.loads(row["checks"])[0]["value"] in tok.decode(ep_good.tokens[t1.end:t1.obs_end])
    assert not any(ep_good.loss_mask[t1.end:t1.obs_end])
    assert all(env.closed and env._session is None for env in envs)
