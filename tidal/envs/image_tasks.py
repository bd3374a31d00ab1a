"""Image tasks for vision-language RL: small pictures drawn with PIL, answers a verifier checks.

Three built-in tasks, each an environment class with its own rows (`rows(split, n, seed)`):

- `vlm_color` (ColorEnv): a big and a small square of different colours on white; "What color
  is the big square?" → `<answer>blue</answer>`.
- `vlm_count` (CountEnv): squares on a 4×4 grid, 1–4 red ones among 1–3 of other colours;
  "How many red squares are there?" → `<answer>3</answer>`.
- `vlm_zoom` (ZoomEnv, multi-turn): a 224×224 scene of four 112×112 quarters, each holding one
  square (22–30 px) of its own colour. The prompt shows the scene downscaled to 28×28, where a
  square is 3–4 pixels across, and asks for the colour of the square in one quarter ("the lower
  left quarter"); the `zoom(region)` tool returns that quarter at full resolution, as a picture in
  the tool's answer. The answer needs the zoomed detail.

The pictures are sized for the embedded tiny VLM (tidal/recipes/tiny_vlm.py: 14-pixel patches
merged 2×2, so a 56×56 picture is 4 image tokens and a 112×112 quarter 16; the processor enlarges
the 28×28 overview to 56×56, blurred). The single-turn tasks are the two measured learning in seconds
of RL (docs/multimodal.md, "The embedded tiny vision-language model"); a zoomed square is as large, in patches, as `vlm_color`'s big
square, which the tiny model's vision tower learns to read quickly (a 10–14 px one it did not
learn to read in the warm start's budget). Rendering uses integer rectangles only (no
anti-aliasing, no fonts), so the same seed gives the same pixels and, through `ImageBlob`, the
same PNG bytes.

Splits: rows are drawn from a generator seeded by the split and the seed, and a picture belongs
to the held-out split when the first byte of a hash of its content id (for `vlm_zoom`, the
scene's) falls in one bucket of ten, as tidal/envs/tool_arith.py does for its
problems; so train and held-out never share a picture, whatever the seeds and sizes. Rows carry
the prompt as chat messages with image parts (`{"type": "image", "image": ImageBlob}`), the
`answer` column, and what a scripted teacher needs to answer the task right or with a habit
(tidal/recipes/vlm_build.py): the colours of both squares, the number of all squares, the colour
of every quarter's square.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from PIL import Image, ImageDraw

from tidal.envs.single_turn import SingleTurnEnv
from tidal.envs.tool_env import ToolEnv
from tidal.images import ImageBlob, as_image, from_pil

HELD_OUT_BUCKETS = 10
BACKGROUND = (255, 255, 255)
# Colours far apart in RGB, each a word the answer names.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220),
    "yellow": (240, 200, 20), "purple": (140, 50, 180), "orange": (250, 130, 20),
}
# The count task's distractors: no orange (the nearest colour to red at a few pixels).
DISTRACTORS = ("green", "blue", "yellow", "purple")
REWARD = "tidal.rewards.vision:score"

Region = Literal["top_left", "top_right", "bottom_left", "bottom_right"]
REGIONS: tuple[str, ...] = ("top_left", "top_right", "bottom_left", "bottom_right")

SIZE = 56  # the single-turn pictures
SCENE = 224  # the zoom task's full-resolution scene: four 112×112 quarters
OVERVIEW = 28  # the zoom task's overview: the scene downscaled 8×
ZOOM_SQUARE = (22, 30)  # side of a quarter's square, pixels at full resolution
GRID = 4  # the count task's cells per side


# ---------------------------------------------------------------------------------------------
# pictures


def _square(draw: ImageDraw.ImageDraw, x: int, y: int, side: int, color: str) -> None:
    draw.rectangle((x, y, x + side - 1, y + side - 1), fill=COLORS[color])


def _apart(a: tuple[int, int, int], b: tuple[int, int, int], gap: int) -> bool:
    """Two squares (x, y, side) at least `gap` pixels apart on one axis."""
    (ax, ay, asd), (bx, by, bsd) = a, b
    return ax + asd + gap <= bx or bx + bsd + gap <= ax or ay + asd + gap <= by or by + bsd + gap <= ay


def color_picture(rng: random.Random) -> tuple[Image.Image, dict[str, Any]]:
    """A big square (22–30 px) and a small one (8–12 px) of two different colours, apart."""
    big_color, small_color = rng.sample(sorted(COLORS), 2)
    big_side, small_side = rng.randint(22, 30), rng.randint(8, 12)
    while True:
        big = (rng.randint(2, SIZE - 2 - big_side), rng.randint(2, SIZE - 2 - big_side), big_side)
        small = (rng.randint(2, SIZE - 2 - small_side), rng.randint(2, SIZE - 2 - small_side), small_side)
        if _apart(big, small, 3):
            break
    img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(img)
    _square(draw, *big, big_color)
    _square(draw, *small, small_color)
    return img, {"big_color": big_color, "small_color": small_color}


def count_picture(rng: random.Random) -> tuple[Image.Image, dict[str, Any]]:
    """1–4 red squares and 1–3 of the other colours, 10 px each, in distinct cells of a 4×4 grid
    of 14-pixel cells (one image patch each), jittered inside their cell."""
    reds, others = rng.randint(1, 4), rng.randint(1, 3)
    cells = rng.sample(range(GRID * GRID), reds + others)
    colors = ["red"] * reds + [rng.choice(DISTRACTORS) for _ in range(others)]
    img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(img)
    cell = SIZE // GRID
    for c, color in zip(cells, colors):
        x, y = (c % GRID) * cell + rng.randint(1, 3), (c // GRID) * cell + rng.randint(1, 3)
        _square(draw, x, y, 10, color)
    return img, {"red": reds, "squares": reds + others}


def zoom_scene(rng: random.Random) -> tuple[Image.Image, dict[str, Any]]:
    """Four quarters, each with one square (`ZOOM_SQUARE` px) of a colour of its own, 4 px or more
    from the quarter's edges."""
    img = Image.new("RGB", (SCENE, SCENE), BACKGROUND)
    draw = ImageDraw.Draw(img)
    colors = dict(zip(REGIONS, rng.sample(sorted(COLORS), len(REGIONS))))
    for i, region in enumerate(REGIONS):
        side = rng.randint(*ZOOM_SQUARE)
        half = SCENE // 2
        x, y = (i % 2) * half + rng.randint(4, half - 4 - side), (i // 2) * half + rng.randint(4, half - 4 - side)
        _square(draw, x, y, side, colors[region])
    return img, {"colors": colors}


def region_box(region: str, width: int, height: int) -> tuple[int, int, int, int]:
    """The (left, top, right, bottom) box of one quarter of a width × height picture."""
    if region not in REGIONS:
        raise ValueError(f"unknown region {region!r} (regions: {', '.join(REGIONS)})")
    i = REGIONS.index(region)
    w, h = width // 2, height // 2
    return (i % 2) * w, (i // 2) * h, (i % 2) * w + w, (i // 2) * h + h


def zoom(scene: ImageBlob, region: str) -> ImageBlob:
    """One quarter of `scene` at full resolution."""
    return from_pil(scene.pil().crop(region_box(region, scene.width, scene.height)))


def overview(scene: ImageBlob, size: int = OVERVIEW) -> ImageBlob:
    """The scene downscaled to `size`×`size` (a box filter: each pixel the mean of its block)."""
    return from_pil(scene.pil().resize((size, size), Image.Resampling.BOX))


# ---------------------------------------------------------------------------------------------
# rows


COLOR_QUESTION = "What color is the big square? Answer as <answer>color</answer>."
COUNT_QUESTION = "How many red squares are there? Answer as <answer>number</answer>."


# The question names a quarter in other words than the tool's argument (upper left → top_left). The
# tool's schema in the system turn lists every argument value, so the value's own tokens would have
# five places to be copied from; measured, the tiny model did not learn to pick the question's (its
# calls named the right quarter 25% of the time, chance), while words found only in the question
# are learned as a lookup.
QUARTER_WORDS = {"top_left": "upper left", "top_right": "upper right", "bottom_left": "lower left",
                 "bottom_right": "lower right"}


def zoom_question(region: str) -> str:
    return (f"What color is the square in the {QUARTER_WORDS[region]} quarter? "
            "zoom(region) shows a quarter up close. Answer as <answer>color</answer>.")


def _held_out(key: str) -> bool:
    return hashlib.sha256(key.encode()).digest()[0] % HELD_OUT_BUCKETS == 0


def image_prompt(image: ImageBlob, text: str) -> list[dict[str, Any]]:
    """One user message: the picture, then the question."""
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def _draw_rows(task: str, split: str, n: int, seed: int,
               draw_one: Callable[[random.Random], tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """`n` distinct rows of `split`: `draw_one(rng)` gives (the picture's key, row); a key decides the
    split and is drawn once."""
    if split not in ("train", "test"):
        raise ValueError(f"{task}: split must be 'train' or 'test', got {split!r}")
    if n < 0:
        raise ValueError(f"{task}: n must be >= 0, got {n}")
    rng = random.Random(f"{task}-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(n * 50 + 1000):
        if len(rows) == n:
            break
        key, row = draw_one(rng)
        if key in seen or _held_out(key) != (split == "test"):
            continue
        seen.add(key)
        row["task_id"] = f"{task}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        rows.append(row)
    if len(rows) < n:
        raise ValueError(f"{task}: could only draw {len(rows)} distinct {split} pictures of {n}")
    return rows


def color_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    def one(rng: random.Random):
        img, meta = color_picture(rng)
        blob = from_pil(img)
        return blob.id, {"prompt": image_prompt(blob, COLOR_QUESTION), "answer": meta["big_color"], **meta}

    return _draw_rows("vlm_color", split, n, seed, one)


def count_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    def one(rng: random.Random):
        img, meta = count_picture(rng)
        blob = from_pil(img)
        return blob.id, {"prompt": image_prompt(blob, COUNT_QUESTION), "answer": str(meta["red"]),
                         "squares": meta["squares"]}

    return _draw_rows("vlm_count", split, n, seed, one)


def zoom_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    def one(rng: random.Random):
        img, meta = zoom_scene(rng)
        region = rng.choice(REGIONS)
        scene = from_pil(img)
        return scene.id, {
            "prompt": image_prompt(overview(scene), zoom_question(region)), "answer": meta["colors"][region],
            "scene": scene, "region": region, "colors": meta["colors"]}

    return _draw_rows("vlm_zoom", split, n, seed, one)


# ---------------------------------------------------------------------------------------------
# environments


class ColorEnv(SingleTurnEnv):
    """`vlm_color`: which colour is the big square (module docstring)."""

    name = "vlm_color"
    default_reward: ClassVar[str] = REWARD

    @classmethod
    def rows(cls, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        return color_rows(split, n, seed)


class CountEnv(SingleTurnEnv):
    """`vlm_count`: how many red squares (module docstring)."""

    name = "vlm_count"
    default_reward: ClassVar[str] = REWARD

    @classmethod
    def rows(cls, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        return count_rows(split, n, seed)


class ZoomEnv(ToolEnv):
    """`vlm_zoom`: the overview in the prompt, `zoom(region)` for a quarter at full resolution,
    then the answer (module docstring). The row's `scene` is the full-resolution picture (any
    shape tidal.images.as_image reads: a dataset may give a path). env_args are ToolEnv's."""

    name: ClassVar[str] = "vlm_zoom"
    default_reward: ClassVar[str] = REWARD

    @classmethod
    def rows(cls, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        return zoom_rows(split, n, seed)

    def __init__(self, row: dict[str, Any], seed: int = 0, **env_args: Any):
        if "scene" not in row:
            raise ValueError(f"{type(self).__name__}: the row has no `scene` column, the full-resolution picture "
                             f"zoom crops (columns: {sorted(row)})")
        scene = as_image(row["scene"], "the row's `scene`")

        def zoom_tool(region: Region) -> ImageBlob:
            """Show one quarter of the picture at full resolution.

            Args:
                region: the quarter to show
            """
            return zoom(scene, region)

        zoom_tool.__name__ = "zoom"
        super().__init__(row, seed, tools=[zoom_tool], **env_args)
