"""The image tasks (tidal/envs/image_tasks.py), their reward (tidal/rewards/vision.py), tools that return
pictures (tidal/envs/tools.py) and the tiny VLM's builder (tidal/recipes/vlm_build.py): rows deterministic
and splits disjoint, right answers score 1 and the teacher's hasty ones 0, the zoom tool answers with the
quarter's picture and a bad region with an error observation, teacher demonstrations through the real
rollout, and a short build that gives the same bytes twice (slow)."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json

import numpy as np
import pytest
from PIL import Image

from tidal.envs.base import Action
from tidal.envs.image_tasks import (
    COLORS,
    OVERVIEW,
    REGIONS,
    SCENE,
    SIZE,
    ZOOM_SQUARE,
    ColorEnv,
    CountEnv,
    ZoomEnv,
    _held_out,
    overview,
    region_box,
)
from tidal.envs.tools import execute, parse_tool_calls, tool_content
from tidal.images import ImageBlob, as_image
from tidal.recipes.tool_model import call_text
from tidal.rewards.vision import score

ENVS = {"vlm_color": ColorEnv, "vlm_count": CountEnv, "vlm_zoom": ZoomEnv}


def picture_of(row) -> ImageBlob:
    (part,) = [p for p in row["prompt"][0]["content"] if p["type"] == "image"]
    return part["image"]


def count_pixels(img: Image.Image, rgb: tuple[int, int, int]) -> int:
    return int((np.asarray(img.convert("RGB")) == np.array(rgb, dtype=np.uint8)).all(-1).sum())


def key_of(name: str, row) -> str:
    return row["scene"].id if name == "vlm_zoom" else picture_of(row).id


@pytest.mark.parametrize("name", list(ENVS))
def test_rows_are_deterministic_and_the_splits_disjoint(name):
    env = ENVS[name]
    a, b = env.rows("train", 40, seed=3), env.rows("train", 40, seed=3)
    assert [picture_of(r).png for r in a] == [picture_of(r).png for r in b]  # same seed, same bytes
    assert [r["answer"] for r in a] == [r["answer"] for r in b]
    other = env.rows("train", 40, seed=4)
    assert {picture_of(r).id for r in a} != {picture_of(r).id for r in other}
    train, test = env.rows("train", 300, seed=0), env.rows("test", 60, seed=0)
    train_keys, test_keys = {key_of(name, r) for r in train}, {key_of(name, r) for r in test}
    assert len(train_keys) == 300 and len(test_keys) == 60  # distinct within a split
    assert not train_keys & test_keys
    # the split is a property of the picture, not of the seed: another seed's test rows are test too
    assert all(_held_out(key_of(name, r)) for r in env.rows("test", 20, seed=9))
    assert not any(_held_out(key_of(name, r)) for r in train)
    assert len({r["task_id"] for r in train}) == 300
    with pytest.raises(ValueError, match="split must be"):
        env.rows("validation", 1, seed=0)


def test_pictures_show_what_the_row_says():
    (row,) = ColorEnv.rows("train", 1, seed=0)
    img = picture_of(row).pil()
    assert img.size == (SIZE, SIZE)
    counts = {name: count_pixels(img, rgb) for name, rgb in COLORS.items()}
    assert counts[row["big_color"]] >= 22 * 22 and 8 * 8 <= counts[row["small_color"]] <= 12 * 12
    assert row["answer"] == row["big_color"] != row["small_color"]
    for row in CountEnv.rows("train", 20, seed=0):
        reds = count_pixels(picture_of(row).pil(), COLORS["red"])
        assert reds == 100 * int(row["answer"])  # 10×10 pixels per red square, none overlapping
        assert row["squares"] > int(row["answer"])  # a distractor always: the hasty count is wrong
    for row in ZoomEnv.rows("train", 10, seed=0):
        assert row["region"] in REGIONS and row["answer"] == row["colors"][row["region"]]
        assert len(set(row["colors"].values())) == 4  # one colour per quarter
        assert picture_of(row).id == overview(row["scene"]).id and picture_of(row).width == OVERVIEW
        crop = row["scene"].pil().crop(region_box(row["region"], SCENE, SCENE))
        lo, hi = ZOOM_SQUARE
        assert lo * lo <= count_pixels(crop, COLORS[row["answer"]]) <= hi * hi  # its square, at full resolution
        # in the overview (an 8× box filter) the square keeps its exact colour on at most a 3×3 patch
        assert count_pixels(picture_of(row).pil(), COLORS[row["answer"]]) <= 9


@pytest.mark.parametrize("name", list(ENVS))
def test_the_right_answer_scores_one_and_the_hasty_habit_zero(name):
    from tidal.recipes.vlm_build import teacher_turns

    for row in ENVS[name].rows("test", 10, seed=0):
        assert score(f"<answer>{row['answer']}</answer>", row["answer"]) == {"correct": 1.0, "format": 0.1}
        assert score(teacher_turns(name, row, careful=True)[-1], row["answer"])["correct"] == 1.0
        assert score(teacher_turns(name, row, careful=False)[-1], row["answer"]) == {"correct": 0.0, "format": 0.1}
    assert score("<answer> Red </answer>", "red")["correct"] == 1.0  # case and spaces aside
    assert score("red", "red") == {"correct": 0.0, "format": 0.0}
    assert score("<answer>blue</answer> <answer>red</answer>", "red") == {"correct": 1.0, "format": 0.0}
    assert score('<tool_call>{"name": "zoom"}</tool_call><answer>red</answer>', "red")["format"] == 0.0


def run_zoom(row, turns: list[str]):
    async def go():
        env = ZoomEnv(row, seed=0)
        first = await env.reset()
        outs = [await env.step(Action(t, turn=i)) for i, t in enumerate(turns)]
        await env.close()
        return env, first, outs

    return asyncio.run(go())


def test_the_zoom_tool_returns_the_quarter_and_a_bad_region_is_an_error_observation():
    (row,) = ZoomEnv.rows("train", 1, seed=0)
    env, first, (call, bad, answer) = run_zoom(row, [
        call_text("zoom", {"region": row["region"]}), call_text("zoom", {"region": "middle"}),
        f"<answer>{row['answer']}</answer>"])
    assert [t["function"]["name"] for t in env.tools] == ["zoom"]
    assert env.tools[0]["function"]["parameters"]["properties"]["region"]["enum"] == list(REGIONS)
    assert first == row["prompt"]
    assert not call.done and call.tool_calls[0].status == "ok"
    (msg,) = call.messages
    assert msg["role"] == "tool" and msg["name"] == "zoom"
    (part,) = msg["content"]
    assert part["type"] == "image" and isinstance(part["image"], ImageBlob)
    expected = row["scene"].pil().crop(region_box(row["region"], SCENE, SCENE))
    assert (part["image"].width, part["image"].height) == (SCENE // 2, SCENE // 2)
    assert part["image"].pil().tobytes() == expected.tobytes()
    assert not bad.done and bad.tool_calls[0].status == "args" and bad.metrics["tools/errors/args"] == 1.0
    assert isinstance(bad.messages[0]["content"], str) and "must be one of" in bad.messages[0]["content"]
    assert answer.done
    with pytest.raises(ValueError, match="no `scene` column"):
        ZoomEnv({"prompt": row["prompt"]})


def square(color: str, size: int = 20) -> Image.Image:
    return Image.new("RGB", (size, size), COLORS[color])


def run_tool(fn, max_chars: int = 2000):
    ex = asyncio.run(execute(parse_tool_calls(call_text(fn.__name__, {})).calls, [fn], max_output_chars=max_chars))
    return ex.messages[0]["content"], ex.records[0]


def test_a_tool_may_return_a_picture_a_blob_or_a_list_of_text_and_pictures():
    red, blue = square("red"), as_image(square("blue"))

    def pil() -> Image.Image:
        """A PIL picture."""
        return red

    def blob() -> ImageBlob:
        """A picture as a blob."""
        return blue

    def mixed() -> list:
        """Text and pictures."""
        return ["before", red, {"type": "text", "text": "between"}, {"type": "image", "image": blue}, 7]

    content, rec = run_tool(pil)
    assert rec.status == "ok" and content == [{"type": "image", "image": as_image(red)}]
    assert content[0]["image"].pil().tobytes() == red.tobytes()
    content, _ = run_tool(blob)
    assert content == [{"type": "image", "image": blue}]
    content, rec = run_tool(mixed)
    assert [p["type"] for p in content] == ["text", "image", "text", "image", "text"]
    assert [p.get("text") for p in content] == ["before", None, "between", None, "7"]
    assert content[1]["image"].id == as_image(red).id and content[3]["image"] is blue
    assert rec.output_chars == len("before") + len("between") + 1


def test_truncation_bounds_the_text_parts_only_and_a_bad_picture_is_an_error():
    red = square("red", 200)

    def long() -> list:
        """Much text around a picture."""
        return ["x" * 30, red, "y" * 30]

    content, rec = run_tool(long, max_chars=40)
    assert content[0] == {"type": "text", "text": "x" * 30}
    assert content[1]["image"].width == 200  # a picture is not cut
    assert content[2]["text"].startswith("y" * 10 + "\n...[truncated 20 chars]")  # the budget's last 10
    assert rec.output_chars == 60
    parts, chars = tool_content(["a" * 5, red, "b" * 5], max_chars=5)
    assert parts[2]["text"] == "\n...[truncated 5 chars]" and chars == 10  # past the budget: only the marker
    assert tool_content(["no", "pictures"], 100) == ('["no", "pictures"]', 18)  # text as before

    def broken() -> dict:
        """A picture part without a picture."""
        return {"type": "image", "image": b"not a png"}

    content, rec = run_tool(broken)
    assert rec.status == "raised" and content.startswith("error: `broken` returned an image that cannot be read")


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from tidal.models import load_tokenizer
    from tidal.models.vision import Vision
    from tidal.recipes.tiny_vlm import build_untrained_vlm
    from tidal.recipes.vlm_build import task_corpus

    rows = {name: env.rows("train", 30, seed=1) for name, env in ENVS.items()}
    d = build_untrained_vlm(tmp_path_factory.mktemp("vlm"), corpus=task_corpus(rows))
    return load_tokenizer(d), Vision.load(d)


def test_teacher_demonstrations_run_through_the_rollout_with_both_habits(tiny_vlm):
    """Each habit's demonstration is an ok episode of the real rollout: the careful zoom calls the
    tool and sees the quarter (two pictures), the hasty one answers at once (one picture) with the
    colour of the opposite quarter."""
    from tidal.recipes.vlm_build import demonstrations

    tok, vision = tiny_vlm
    rows = ZoomEnv.rows("test", 2, seed=0)
    careful, hasty = demonstrations(tok, vision, "vlm_zoom", rows, [True, False])
    tokens, mask, images = careful
    assert [b.id for b in images] == [picture_of(rows[0]).id, asyncio.run(_zoomed(rows[0])).id]
    assert [e - s for s, e in vision.runs(tokens)] == [4, 16]  # the 28×28 overview enlarged to 56×56; 112×112
    said = tok.decode([t for t, m in zip(tokens, mask) if m], skip_special_tokens=True)
    assert said == call_text("zoom", {"region": rows[0]["region"]}) + f"<answer>{rows[0]['answer']}</answer>"
    tokens, mask, images = hasty
    opposite = REGIONS[3 - REGIONS.index(rows[1]["region"])]
    assert len(images) == 1 and tok.decode([t for t, m in zip(tokens, mask) if m], skip_special_tokens=True) == \
        f"<answer>{rows[1]['colors'][opposite]}</answer>"
    (color,) = demonstrations(tok, vision, "vlm_color", ColorEnv.rows("test", 1, seed=0), [False])
    assert vision.image_token_id not in [t for t, m in zip(color[0], color[1]) if m]


async def _zoomed(row) -> ImageBlob:
    env = ZoomEnv(row)
    out = await env.step(Action(call_text("zoom", {"region": row["region"]})))
    return out.messages[0]["content"][0]["image"]


def test_named_models_and_registered_envs():
    from tidal.config import TaskConfig
    from tidal.models import DEFAULT_VLM_DIR, resolve_model_dir
    from tidal.runtime.tasks import build_task

    if (DEFAULT_VLM_DIR / "config.json").is_file():
        assert resolve_model_dir("default-vlm") == DEFAULT_VLM_DIR
    for name, env in ENVS.items():
        task = build_task(TaskConfig(env=name, train_size=5, eval_size=3, seed=0))
        assert task.env_cls is env and len(task.train_rows) == 5 and len(task.eval_rows) == 3
        assert [s.fn for s in task.rewards] == ["tidal.rewards.vision:score"]


@pytest.mark.slow
def test_the_builder_is_deterministic(tmp_path):
    """Two very short builds with one seed give the same files, byte for byte (one thread: the float
    summation order is fixed)."""
    import torch

    from tidal.recipes.vlm_build import build_default_vlm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kwargs = dict(steps=6, batch_size=4, train_size={"vlm_color": 20, "vlm_count": 20, "vlm_zoom": 12},
                      eval_n=4, eval_k=2)
        a = build_default_vlm(tmp_path / "a", seed=0, **kwargs)
        b = build_default_vlm(tmp_path / "b", seed=0, **kwargs)
    finally:
        torch.set_num_threads(threads)
    digest = {d: {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted((tmp_path / d).iterdir())
                  if f.name != "tidal_build.json"} for d in ("a", "b")}
    assert digest["a"] == digest["b"] and "model.safetensors" in digest["a"] and "preprocessor_config.json" in digest["a"]
    assert a["val"] == b["val"] and a["loss"] == b["loss"]
    recorded = json.loads((tmp_path / "a" / "tidal_build.json").read_text())
    assert recorded["steps"] == 6 and set(recorded["val"]) == set(ENVS)


def test_the_shipped_tiny_vlm_is_wrong_greedily_and_right_among_its_samples():
    """The embedded model, through the torch engine and the rollout: on held-out pictures its greedy
    answer follows the hasty habit (mostly wrong) while a right answer is among 8 samples. The
    bounds leave room around what the build measured on 200 held-out rows (greedy 0.045 / 0.035 /
    0.18, pass@8 0.935 / 0.90 / 0.94): 40 rows, and float summation order differs across machines."""
    from tidal.models import DEFAULT_VLM_DIR, load_model, load_tokenizer
    from tidal.models.vision import Vision
    from tidal.recipes.vlm_build import build_default_vlm, held_out

    record = json.loads((DEFAULT_VLM_DIR / "tidal_build.json").read_text())
    model, tok, vision = load_model(DEFAULT_VLM_DIR), load_tokenizer(DEFAULT_VLM_DIR), Vision.load(DEFAULT_VLM_DIR)
    assert set(record["val"]) == set(ENVS) and record["params"] == sum(p.numel() for p in model.parameters())
    # the shipped directory is what `tidal build-default-vlm` makes: its record has the builder's defaults
    defaults = {k: p.default for k, p in inspect.signature(build_default_vlm).parameters.items()}
    for key in ("seed", "steps", "see_steps", "batch_size", "lr", "warmup"):
        assert record[key] == defaults[key], key
    assert record["careful"] == {name: 0.3 for name in ENVS} and record["threads"] == 2  # the CLI's default
    for name, env in ENVS.items():
        res = held_out(model, tok, vision, name, env.rows("test", 40, seed=0), k=8)
        assert res["failed"] == 0
        assert res["accuracy"] <= 0.35 and res["pass_at_k"] >= 0.75, (name, res)
