"""A run directory holding one vision-language episode, for the dashboard's tests
(tests/test_dashboard.py, tests/test_dashboard_browser.py): the untrained tiny VLM's tokenizer,
a chat-templated prompt with two pictures of different sizes expanded by the model's own image
processor (8 and 4 image tokens), an answer, and the store's writer saving the pictures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml
from PIL import Image, ImageDraw

from tidal.images import ImageBlob, as_image
from tidal.models import load_tokenizer
from tidal.models.vision import Vision
from tidal.monitor.episodes import EpisodeWriter
from tidal.recipes.tiny_vlm import build_untrained_vlm
from tidal.types import Episode, Turn


@dataclass
class VlmRun:
    dir: Path
    episode: Episode
    blobs: list[ImageBlob]
    pad_id: int


def picture(color: str, size: tuple[int, int]) -> Image.Image:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle((4, 4, size[0] // 2, size[1] // 2), fill=color)
    return img


def make_vlm_run(root: Path) -> VlmRun:
    model = build_untrained_vlm(root / "model")
    tok, vision = load_tokenizer(model), Vision.load(model)
    blobs = [as_image(picture("red", (100, 60))), as_image(picture("blue", (56, 56)))]
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is red?"}]}],
        add_generation_prompt=True, tokenize=False)
    prompt = vision.expand(tok(rendered, add_special_tokens=False)["input_ids"], blobs)
    answer = tok("<answer>left</answer><|im_end|>", add_special_tokens=False)["input_ids"]
    n = len(prompt) + len(answer)
    episode = Episode(
        episode_id="s1-p0-e0", group_id="s1-p0", task_id="which-red", env="image_choice", tokens=prompt + answer,
        loss_mask=[False] * len(prompt) + [True] * len(answer), logprobs=[0.0] * len(prompt) + [-0.5] * len(answer),
        versions=[-1] * len(prompt) + [0] * len(answer), reward=1.0, reward_parts={"correct": 1.0}, prompt_len=len(prompt),
        step=1, turns=[Turn(0, len(prompt), n, n, "<answer>left</answer>", "stop", 0.0, [], 0)],
        images=[b.id for b in blobs], image_blobs={b.id: b for b in blobs})
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(model)}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 1.0}) + "\n")
    with EpisodeWriter(run / "episodes", tok) as w:
        w.write(1, [episode])
    return VlmRun(run, episode, blobs, vision.image_token_id)
