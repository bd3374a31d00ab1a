"""The episode store streams episodes to Parquet as they finish and gives them back whole;
`ScriptedEngine` answers as its script says, within the request's limits."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from engine_checks import first_stop_end

from tidal.engines.scripted import ScriptedEngine, ScriptExhausted
from tidal.envs.base import StepResult
from tidal.models import DEFAULT_MODEL_DIR, load_tokenizer, stop_token_ids
from tidal.monitor.episodes import SCHEMA, EpisodeWriter, episode_files, iter_episodes, read_episodes
from tidal.runtime.rollout import EpisodeSpec, Rollout
from tidal.types import Episode, GenerationRequest, SamplingParams, Status, ToolCallRecord, Turn


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL_DIR)


def make_episode(i: int, step: int = 1, n_tokens: int = 12) -> Episode:
    """A two-turn episode with a tool call; log-probs are float32 values (as engines give)."""
    tokens = [(7 * i + k) % 250 + 3 for k in range(n_tokens)]
    mask = [k >= 4 and k % 3 != 0 for k in range(n_tokens)]
    calls = [ToolCallRecord("calc", f'{{"x": {i}}}', f"call{i}", "ok" if i % 2 else "args",
                            "" if i % 2 else "x must be positive", 3 * i, 0.125 * i)]
    turns = [Turn(0, 4, 8, 9, f"turn ü {i}", "stop", 0.5 * i, calls, 2),
             Turn(1, 9, n_tokens, n_tokens, "done", "length", -1.0, [], 3)]
    failed = i % 5 == 4
    return Episode(
        f"s{step}-e{i}", f"s{step}-g{i // 4}", str(i // 4), "tool_env", tokens=tokens, loss_mask=mask,
        logprobs=[-0.25 * k if m else 0.0 for k, m in enumerate(mask)],
        versions=[3 if m else -1 for m in mask], reward=float("nan") if failed else 1.0 + i,
        reward_parts={} if failed else {"correct": 1.0, "format": float(i)},
        status=Status.ENV_ERROR if failed else Status.OK, error="env raised" if failed else "",
        metrics={"turns": 2.0, "tools/calls": 1.0}, prompt_len=4, step=step, seed=2**62 + i, turns=turns,
        segments=[0, 9] if i % 3 == 0 else [0], outcome_reward=0.0 if failed else 1.0,
    )


def same(a: Episode, b: Episode) -> bool:
    """Field-by-field equality, NaN equal to NaN (a failed episode's reward)."""
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    if math.isnan(da["reward"]) and math.isnan(db["reward"]):
        da["reward"] = db["reward"] = 0.0
    return da == db and type(a.status) is type(b.status)


def test_schema_stores_every_episode_field():
    # a field added to Episode and not to the store would be silently lost (image_blobs: the pictures, which
    # the store keeps as files under images/, by the ids of the `images` column)
    assert {f.name for f in dataclasses.fields(Episode)} - {"image_blobs"} <= set(SCHEMA.names)
    assert "images" in SCHEMA.names
    turn_type = SCHEMA.field("turns").type.value_type
    assert {f.name for f in dataclasses.fields(Turn)} == {turn_type.field(i).name for i in range(turn_type.num_fields)}
    call_type = turn_type.field("tool_calls").type.value_type
    assert {f.name for f in dataclasses.fields(ToolCallRecord)} == {call_type.field(i).name
                                                                    for i in range(call_type.num_fields)}


def test_streaming_round_trip_with_turns_and_tool_calls(tmp_path, tok):
    step1 = [make_episode(i, step=1) for i in range(10)]
    step2 = [make_episode(i, step=2) for i in range(10, 17)]
    w = EpisodeWriter(tmp_path, tok, row_group_episodes=4)
    # asynchronous training: step 2's episodes arrive before step 1 has ended
    for a, b in zip(step1, step2 + [None] * 3):
        w.add(a)
        if b is not None:
            w.add(b)
    assert w.end_step(1) == [tmp_path / "step_000001.parquet"]
    assert w.end_step(2) == [tmp_path / "step_000002.parquet"]
    back = list(iter_episodes(tmp_path, batch_size=3))
    assert len(back) == 17
    assert all(same(x, y) for x, y in zip(back, step1 + step2))
    assert back[4].status is Status.ENV_ERROR and math.isnan(back[4].reward)
    assert back[1].turns[0].tool_calls[0].error == "" and back[2].turns[0].tool_calls[0].status == "args"
    table = read_episodes(tmp_path)
    assert table.column("text").to_pylist() == [tok.decode(e.tokens) for e in step1 + step2]
    # per-turn rewards and tool outcomes are plain columns once the turns are unnested
    turns = pc.list_flatten(table.column("turns"))
    assert pc.struct_field(turns, "reward").to_pylist() == [r for i in range(17) for r in (0.5 * i, -1.0)]
    calls = pc.list_flatten(pc.struct_field(turns, "tool_calls"))
    assert pc.struct_field(calls, "status").to_pylist().count("args") == sum(1 for i in range(17) if i % 2 == 0)


def test_a_row_is_the_episode_as_it_was_added(tmp_path):
    # the controller shapes rewards and marks `trained` after the rollout; rows already written
    # and rows still buffered must agree on what they record
    w = EpisodeWriter(tmp_path, row_group_episodes=2)
    eps = [make_episode(i) for i in (1, 2, 3)]
    for e in eps:
        w.add(e)
    for e in eps:  # episodes 1 and 2 are written by now, 3 is buffered
        e.reward -= 0.5
        e.metrics["trained"] = 0.0
        e.reward_parts["penalty"] = -0.5
    w.end_step(1)
    back = read_episodes(tmp_path)
    assert back.column("reward").to_pylist() == [2.0, 3.0, 4.0]
    assert all("trained" not in dict(m) and "penalty" not in dict(p)
               for m, p in zip(back.column("metrics").to_pylist(), back.column("reward_parts").to_pylist()))


def test_text_column_is_optional(tmp_path, tok):
    with EpisodeWriter(tmp_path, tok, decode_text=False) as w:
        w.add_many(make_episode(i) for i in range(3))
    assert read_episodes(tmp_path).column("text").to_pylist() == ["", "", ""]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        EpisodeWriter(tmp_path / "x", None, decode_text=True)


def test_a_file_appears_only_whole(tmp_path):
    w = EpisodeWriter(tmp_path, row_group_episodes=2)
    for i in range(5):
        w.add(make_episode(i))
    # two row groups are on disk already, under a hidden temporary name only
    tmp = [p for p in tmp_path.iterdir()]
    assert [p.name for p in tmp] == [".step_000001.parquet.tmp"] and tmp[0].stat().st_size > 0
    assert list(tmp_path.glob("*.parquet")) == [] and episode_files(tmp_path) == []
    assert read_episodes(tmp_path).num_rows == 0
    assert pq.read_table(tmp_path, schema=SCHEMA).num_rows == 0  # pyarrow's own discovery skips it too
    w.end_step(1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000001.parquet"]
    assert pq.ParquetFile(tmp_path / "step_000001.parquet").metadata.num_rows == 5


def test_buffer_never_exceeds_a_row_group(tmp_path):
    w = EpisodeWriter(tmp_path, row_group_episodes=8)
    seen = []
    for i in range(100):
        w.add(make_episode(i))
        seen.append(w.buffered)
    w.end_step(1)
    assert max(seen) == 7 and w.max_buffered == 8  # the 8th episode fills the group, which is written at once
    assert w.episodes_written == 100
    meta = pq.ParquetFile(tmp_path / "step_000001.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [8] * 12 + [4]
    # a token budget cuts row groups of long episodes earlier: 3 × 12 tokens reach 30
    w2 = EpisodeWriter(tmp_path / "long", row_group_episodes=100, row_group_tokens=30)
    w2.write(1, [make_episode(i) for i in range(7)])
    meta = pq.ParquetFile(tmp_path / "long" / "step_000001.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [3, 3, 1]


def test_a_large_step_is_written_in_parts(tmp_path):
    w = EpisodeWriter(tmp_path, row_group_episodes=5, max_file_episodes=10)
    eps = [make_episode(i, step=3) for i in range(25)]
    assert w.write(3, eps) == tmp_path / "step_000003.parquet"  # the step's first file
    assert [p.name for p in episode_files(tmp_path)] == ["step_000003.parquet", "step_000003.part0001.parquet",
                                                         "step_000003.part0002.parquet"]
    back = list(iter_episodes(tmp_path))
    assert len(back) == 25 and all(same(x, y) for x, y in zip(back, eps))
    # the step written again (a resumed run re-runs it), smaller: no stale part of the old write
    EpisodeWriter(tmp_path, row_group_episodes=5, max_file_episodes=10).write(3, eps[:4])
    assert [p.name for p in episode_files(tmp_path)] == ["step_000003.parquet"]
    assert [e.episode_id for e in iter_episodes(tmp_path)] == [e.episode_id for e in eps[:4]]


def test_write_keeps_the_old_api_and_empty_steps_have_a_file(tmp_path):
    w = EpisodeWriter(tmp_path)
    assert w.write(4, [make_episode(0, step=4)]) == tmp_path / "step_000004.parquet"
    assert w.end_step(5) == [tmp_path / "step_000005.parquet"]
    assert read_episodes(tmp_path / "step_000005.parquet").num_rows == 0
    assert read_episodes(tmp_path).column("step").to_pylist() == [4]


def test_bad_episodes_are_named(tmp_path):
    w = EpisodeWriter(tmp_path, row_group_episodes=2)
    w.add(make_episode(0))
    w.end_step(1)
    with pytest.raises(ValueError, match=r"episode s1-e1 of step 1 arrived after end_step\(1\)"):
        w.add(make_episode(1))
    bad = make_episode(2, step=2)
    bad.logprobs = bad.logprobs[:-1]
    with pytest.raises(ValueError, match="episode s2-e2 of step 2: logprobs has 11 entries for 12 tokens"):
        w.add(bad)
    huge = make_episode(3, step=2)
    huge.tokens[0] = 2**40  # does not fit int32
    w.add(make_episode(4, step=2))
    with pytest.raises(ValueError, match="episode s2-e3 of step 2 does not fit the schema"):
        w.add(huge)
    with pytest.raises(TypeError, match="expected an Episode, got dict"):
        w.add({"episode_id": "x"})


# -- ScriptedEngine ---------------------------------------------------------------------------------------------

def req(rid: str, session: str = "", max_new: int = 16, stops=(2,), stop=()) -> GenerationRequest:
    return GenerationRequest(rid, [1, 5], SamplingParams(max_new_tokens=max_new, stop_token_ids=stops, stop=stop),
                             session_id=session)


def test_scripted_engine_follows_its_script_per_session():
    eng = ScriptedEngine([[10, 11, 2], [12, 13], [14, 2, 15]])
    assert eng.version == 0
    a = asyncio.run(eng.generate([req("a/0", "a"), req("b/0", "b")]))
    assert [r.token_ids for r in a] == [[10, 11, 2], [10, 11, 2]] and [r.finish_reason for r in a] == ["stop"] * 2
    eng.update_weights(7, {})
    b = asyncio.run(eng.generate([req("a/1", "a")]))[0]
    assert (b.token_ids, b.finish_reason, b.logprobs, b.version) == ([12, 13], "length", [0.0, 0.0], 7)
    assert b.versions_per_token() == [7, 7]
    c = asyncio.run(eng.generate([req("a/2", "a")]))[0]
    assert (c.token_ids, c.finish_reason) == ([14, 2], "stop")  # ends at its first stop token, kept
    assert list(eng._sessions) == ["b"] and list(eng._finished) == ["a"]  # a had its last turn
    cut = asyncio.run(eng.generate([req("b/1", "b", max_new=1)]))[0]
    assert (cut.token_ids, cut.finish_reason) == ([12], "length")
    asyncio.run(eng.generate([req("b/2", "b")]))
    with pytest.raises(ScriptExhausted, match="request b/3 asks session `b` for a turn after its last: the script has 3"):
        asyncio.run(eng.generate([req("b/3", "b")]))


def test_scripted_engine_remembers_a_bounded_number_of_sessions():
    eng = ScriptedEngine([[3], [4]], max_sessions=2)
    for s in ("x", "y", "z"):  # x, y, z each have their first turn
        asyncio.run(eng.generate([req(f"{s}/0", s)]))
    assert list(eng._sessions) == ["y", "z"]  # x was served longest ago (an episode that ended early)
    for s in ("y", "z"):
        asyncio.run(eng.generate([req(f"{s}/1", s)]))
    for i in range(3):
        asyncio.run(eng.generate([req(f"w{i}/0", f"w{i}"), req(f"w{i}/1", f"w{i}")]))
    assert not eng._sessions and list(eng._finished) == ["w1", "w2"]


def test_scripted_engine_policy_function_and_stop_strings(tok):
    eng = ScriptedEngine(lambda r: r.prompt_ids[::-1] + [2])
    assert asyncio.run(eng.generate([req("r")]))[0].token_ids == [5, 1, 2]
    text = 'x<tool_call>{"a": 1}</tool_call> tail'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="request r asks for stop strings .* no tokenizer"):
        asyncio.run(ScriptedEngine([ids]).generate([req("r", stop=("</tool_call>",))]))
    for stop in [("</tool_call>",), ('"a"', "no such text"), ("no such text",)]:
        res = asyncio.run(ScriptedEngine([ids], tokenizer=tok).generate([req("r", max_new=64, stop=stop)]))[0]
        k = first_stop_end(tok, ids, stop)  # the contract every engine is held to (tests/engine_checks.py)
        assert res.token_ids == ids[:k or len(ids)] and res.finish_reason == ("stop" if k else "length")
    assert first_stop_end(tok, ids, ("</tool_call>",)) < len(ids)  # the cut happened inside the script's turn


def test_scripted_engine_pause_holds_calls_until_resume():
    eng = ScriptedEngine([[4, 2]])

    async def main():
        eng.pause()
        task = asyncio.create_task(eng.generate([req("p")]))
        await asyncio.sleep(0.05)
        held = not task.done()
        eng.resume()
        return held, await asyncio.wait_for(task, 5)

    held, res = asyncio.run(main())
    assert held and res[0].token_ids == [4, 2]


# -- through the rollout -------------------------------------------------------------------------------------------

class AskTwiceEnv:
    name = "ask_twice"

    def __init__(self):
        self.turn = 0

    async def reset(self):
        return [{"role": "user", "content": "Say hi."}]

    async def step(self, action):
        self.turn += 1
        if self.turn == 1:
            call = ToolCallRecord("echo", action.text, "c1", "ok", "", len(action.text))
            return StepResult([{"role": "user", "content": "Again."}], reward=0.25, done=False, tool_calls=[call])
        return StepResult(reward=1.0, done=True)

    async def close(self):
        pass


def test_rollout_streams_turns_to_the_store(tmp_path, tok):
    eos = stop_token_ids(tok)[0]
    eng = ScriptedEngine.from_texts(tok, ["hi", "hi again"], stop_token_id=eos)
    rollout = Rollout(tok, SamplingParams(max_new_tokens=16, stop_token_ids=(eos,)), max_turns=3)
    specs = [EpisodeSpec(env=AskTwiceEnv(), episode_id=f"e{i}", group_id="g", task_id="t", seed=i) for i in range(6)]
    w = EpisodeWriter(tmp_path, tok, row_group_episodes=4)
    eps = asyncio.run(rollout.run(specs, eng, 1, on_episode=w.add))
    assert w.episodes_written == 4 and w.buffered == 2  # a row group went out while the rollout ran
    w.end_step(1)
    back = list(iter_episodes(tmp_path))
    assert sorted(e.episode_id for e in back) == [e.episode_id for e in eps]
    by_id = {e.episode_id: e for e in eps}
    assert all(same(b, by_id[b.episode_id]) for b in back)
    ep = back[0]
    assert [t.reward for t in ep.turns] == [0.25, 1.0] and ep.turns[0].tool_calls[0].name == "echo"
    assert [tok.decode(ep.tokens[t.start:t.end]) for t in ep.turns] == ["hi<|im_end|>", "hi again<|im_end|>"]
    assert ep.status is Status.OK


def test_store_sizes_are_validated(tmp_path):
    with pytest.raises(ValueError, match="row_group_episodes must be at least 1"):
        EpisodeWriter(tmp_path, row_group_episodes=0)


def test_missing_store_is_named(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="episode store .*nope. does not exist"):
        list(iter_episodes(tmp_path / "nope"))
