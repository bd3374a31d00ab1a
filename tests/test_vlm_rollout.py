"""The rollout with images: placeholders expanded once, requests carry the images, episodes keep them by id,
multi-turn observations with images (a tool that returns one) tokenized exactly, and the episode store keeps
the pictures. The engine is scripted (tidal/engines/scripted.py), so what is checked is the rollout alone."""

from __future__ import annotations

import asyncio

import pytest
from PIL import Image, ImageDraw

from tidal.engines.scripted import ScriptedEngine
from tidal.envs.base import StepResult
from tidal.envs.single_turn import SingleTurnEnv
from tidal.images import as_image
from tidal.models import load_tokenizer, stop_token_ids
from tidal.models.vision import Vision
from tidal.monitor.episodes import EpisodeWriter, episode_images, iter_episodes
from tidal.recipes.tiny_vlm import build_untrained_vlm
from tidal.runtime.rollout import EpisodeSpec, Rollout
from tidal.types import SamplingParams, Status


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    d = build_untrained_vlm(tmp_path_factory.mktemp("vlm"))
    return d, load_tokenizer(d), Vision.load(d)


def picture(color: str, size=(56, 56), box=(8, 8, 40, 40)):
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle(box, fill=color)
    return img


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def run(rollout, env, engine, row=None):
    spec = EpisodeSpec(env, "s0-p0-e0", "s0-p0", "t0", 1, row=row or {})
    return asyncio.run(rollout.run([spec], engine, step=0))[0]


def test_a_row_images_are_expanded_once_and_sent_with_the_request(vlm):
    _, tok, vision = vlm
    img = picture("red", size=(100, 60))  # resized to 56x112: 8 image tokens
    row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color?"}]}],
           "images": [img]}
    seen = []
    answer = ids(tok, "<answer>red</answer><|im_end|>")

    def policy(req):
        seen.append(req)
        return answer

    rollout = Rollout(tok, SamplingParams(max_new_tokens=16, stop_token_ids=stop_token_ids(tok)), vision=vision)
    ep = run(rollout, SingleTurnEnv(row), ScriptedEngine(policy, tokenizer=tok), row)
    assert ep.status == Status.OK, ep.error
    blob = as_image(img)
    rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                       "text": "What color?"}]}], add_generation_prompt=True, tokenize=False)
    prompt = ids(tok, rendered)
    assert prompt.count(vision.image_token_id) == 1
    expected = vision.expand(prompt, [blob])
    assert expected.count(vision.image_token_id) == 8
    assert seen[0].prompt_ids == expected and [b.id for b in seen[0].images] == [blob.id]
    assert ep.tokens == expected + answer
    assert ep.loss_mask == [False] * len(expected) + [True] * len(answer)
    assert ep.images == [blob.id] and ep.image_list()[0].png == blob.png


class ZoomOnce:
    """Two turns: the policy's first turn is answered by a tool message holding an image and a caption."""

    name = "zoom_once"

    def __init__(self, overview, detail):
        self.overview, self.detail = overview, detail

    async def reset(self):
        return [{"role": "user", "content": [{"type": "image", "image": self.overview},
                                             {"type": "text", "text": "Look closer."}]}]

    async def step(self, action):
        if action.turn == 0:
            return StepResult(messages=[{"role": "tool", "name": "zoom", "content": [
                {"type": "image", "image": self.detail}, {"type": "text", "text": "zoomed"}]}], done=False)
        return StepResult(reward=1.0, done=True)

    async def close(self):
        pass


def test_a_tool_image_is_tokenized_exactly_and_the_store_keeps_both_pictures(vlm, tmp_path):
    _, tok, vision = vlm
    overview, detail = picture("blue"), picture("green", size=(112, 112), box=(0, 0, 60, 60))
    turns = [ids(tok, "zoom<|im_end|>"), ids(tok, "<answer>green</answer><|im_end|>")]
    seen = []

    def policy(req):
        seen.append(req)
        return turns[len(seen) - 1]

    rollout = Rollout(tok, SamplingParams(max_new_tokens=16, stop_token_ids=stop_token_ids(tok)), max_turns=2,
                      vision=vision)
    ep = run(rollout, ZoomOnce(overview, detail), ScriptedEngine(policy, tokenizer=tok))
    assert ep.status == Status.OK, ep.error
    a, b = as_image(overview), as_image(detail)
    # The whole conversation rendered at once and expanded equals the tokens the episode grew turn by turn.
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Look closer."}]},
            {"role": "assistant", "content": "zoom"},
            {"role": "tool", "name": "zoom", "content": [{"type": "image"}, {"type": "text", "text": "zoomed"}]},
            {"role": "assistant", "content": "<answer>green</answer>"}]
    whole = vision.expand(ids(tok, tok.apply_chat_template(conv, tokenize=False)), [a, b])
    assert ep.tokens == whole[:len(ep.tokens)] and len(whole) - len(ep.tokens) == len(ids(tok, "\n"))
    assert len(vision.runs(ep.tokens)) == 2 and vision.num_tokens(b) == 16
    # Masks: exactly the two generated turns.
    policy_idx = [i for i, m in enumerate(ep.loss_mask) if m]
    spans = [(t.start, t.end) for t in ep.turns]
    assert policy_idx == [i for s, e in spans for i in range(s, e)]
    assert [ep.tokens[s:e] for s, e in spans] == turns
    # The second request carries both images, in order, and the prompt so far.
    assert [x.id for x in seen[1].images] == [a.id, b.id] and seen[1].prompt_ids == ep.tokens[:spans[1][0]]
    assert ep.images == [a.id, b.id]
    # The store: ids in Parquet, pictures under episodes/images/, read back pixel for pixel.
    with EpisodeWriter(tmp_path / "episodes", tok) as w:
        w.add(ep)
    (back,) = iter_episodes(tmp_path / "episodes")
    assert back.images == [a.id, b.id] and back.tokens == ep.tokens
    pics = episode_images(tmp_path / "episodes", back)
    assert [p.id for p in pics] == [a.id, b.id]
    assert pics[1].pil().tobytes() == detail.convert("RGB").tobytes()


def test_images_for_a_text_only_model_or_a_missing_file_fail_the_episode_by_name(vlm, tmp_path):
    _, tok, vision = vlm
    row = {"prompt": [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "nope.png")},
                                                   {"type": "text", "text": "?"}]}]}
    engine = ScriptedEngine([ids(tok, "x<|im_end|>")], tokenizer=tok)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=stop_token_ids(tok))
    ep = run(Rollout(tok, params, vision=vision), SingleTurnEnv(row), engine, row)
    assert ep.status == Status.ENV_ERROR and "nope.png" in ep.error and "does not exist" in ep.error
    row = {"prompt": [{"role": "user", "content": [{"type": "image", "image": picture("red")}]}]}
    ep = run(Rollout(tok, params), SingleTurnEnv(row), engine, row)  # no vision: a text-only model
    assert ep.status == Status.ENV_ERROR and "text-only" in ep.error
