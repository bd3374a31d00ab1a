"""The torch engine with a vision-language model (the tiny Qwen2-VL, random weights): log-probs equal a
teacher-forced forward of the model over prompt + generation with the same images and mRoPE positions
(the vision special tokens masked), in batches that mix image sizes, image-free rows and left padding;
after a weight update, also for a picture seen before it (the feature cache must not serve the old
vision tower's features); across a session's two turns through the prefix cache; vision special
tokens never sampled; the lean decode step agreeing with the model's own forward; requests whose
images do not fit their prompt refused.

The random model is sharpened so that what is checked shows in the log-probs (tests/vlm_checks.py)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from tests.vlm_checks import sharpened_vlm
from tidal.algorithms import token_logprobs
from tidal.config import EngineConfig
from tidal.engines.factory import build_engine
from tidal.engines.torch_engine import TorchEngine
from tidal.images import as_image
from tidal.models import DEFAULT_MODEL_DIR, load_model, load_tokenizer, stop_token_ids
from tidal.models.vision import Vision, mask_banned
from tidal.types import GenerationRequest, SamplingParams

# fp32, the same weights, two computations of one log-prob: the engine (left-padded batch prefill with
# input embeddings, a KV cache, decode steps at mRoPE positions, rows joining and leaving) vs one
# teacher-forced forward of the whole sequence with pixel values. Measured here <= 1e-6; 1e-4 leaves
# 100x for another CPU's kernels. What it catches moves log-probs by far more: decode positions counted
# in tokens instead of mRoPE by 0.1-0.3, the old vision tower's features after an update by > 1e-2
# (asserted below), an unmasked vision token by > 1 (asserted below).
TOL = 1e-4
SIZES = {"small": (56, 56), "wide": (100, 60), "square": (84, 84)}  # 4, 8 and 9 image tokens


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    d = sharpened_vlm(tmp_path_factory.mktemp("vlm") / "model", vision=True)  # module docstring
    return str(d), load_tokenizer(d), Vision.load(d)


def picture(color: str, size: str):
    w, h = SIZES[size]
    img = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(img).rectangle((4, 6, w // 2 + 9, h // 2 + 3), fill=color)
    return as_image(img)


def user_turn(tok, vision, *parts, first: bool = True) -> tuple[list[int], list]:
    """Token ids of a user message (text and pictures, in order) and the generation prompt, images
    expanded; `first=False`: what follows a generated turn (its end, then the message)."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                   tokenize=False)
    if not first:
        text = "<|im_end|>\n" + text
    blobs = [p for p in parts if not isinstance(p, str)]
    return vision.expand(tok(text, add_special_tokens=False)["input_ids"], blobs), blobs


def request(name: str, ids: list[int], images, tok, *, temperature=0.0, seed=0, max_new_tokens=12, session=""):
    return GenerationRequest(name, list(ids), SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                             seed=seed, stop_token_ids=stop_token_ids(tok)),
                             session_id=session, images=tuple(images))


def teacher(model, vision, req, result, masked: bool = True) -> torch.Tensor:
    """log softmax(logits / T) of each generated token from one forward of the model over prompt +
    generation with the request's images (T = 1 when greedy), the vision tokens masked."""
    ids = req.prompt_ids + result.token_ids
    kw = {}
    if req.images:
        pixel_values, grid = vision.pixels(list(req.images))
        kw = {"pixel_values": pixel_values, "image_grid_thw": grid}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), position_ids=vision.positions(ids, list(req.images))[:, None],
                       **kw).logits[:, :-1]
    if masked:
        logits = mask_banned(logits, vision.banned_token_ids)
    t = req.params.temperature if req.params.temperature > 0 else 1.0
    return token_logprobs(logits, torch.tensor([ids[1:]]), t)[0, len(req.prompt_ids) - 1:]


def worst_vs_teacher(model, vision, reqs, results) -> float:
    return max(float((teacher(model, vision, q, r) - torch.tensor(r.logprobs)).abs().max())
               for q, r in zip(reqs, results, strict=True))


def mixed_batch(tok, vision) -> list[GenerationRequest]:
    """Rows with no image, one image of each size, two images, an image last, a picture that two
    rows share; prompts of different lengths (left padding), greedy and sampled."""
    red, blue, green = picture("red", "small"), picture("blue", "wide"), picture("green", "square")
    turns = [
        user_turn(tok, vision, red, "What color is the big square?"),
        user_turn(tok, vision, "How many red squares are there?"),
        user_turn(tok, vision, blue, "left or right", green, "top"),
        user_turn(tok, vision, "zero one two three four five six seven eight nine", green),
        user_turn(tok, vision, "Hi"),
        user_turn(tok, vision, blue, "What color?"),
        user_turn(tok, vision, "one", red, "two", blue, "three", green),
    ]
    return [request(f"r{i}", ids, blobs, tok, temperature=(0.0, 1.0, 0.7)[i % 3], seed=10 + i,
                    max_new_tokens=6 + 2 * i) for i, (ids, blobs) in enumerate(turns)]


def test_logprobs_equal_teacher_forcing_and_lean_equals_model_forward(vlm):
    d, tok, vision = vlm
    reqs = mixed_batch(tok, vision)
    assert len({len(r.prompt_ids) for r in reqs}) >= 6  # prompts of different lengths: left padding
    model = load_model(d)
    results = {}
    for lean in (True, False):
        # 3 rows at a time: rows finish, leave, and waiting ones join (prefill, then a cache merge).
        engine = TorchEngine(load_model(d), tok.pad_token_id, max_batch_size=3, vision=vision, lean_decode=lean)
        results[lean] = engine.generate_sync(reqs)
        assert engine.lean is lean
        worst = worst_vs_teacher(model, vision, reqs, results[lean])
        assert worst < TOL, f"lean_decode={lean}: engine log-probs differ from teacher forcing by {worst:.3g}"
        assert engine.images_encoded == 3  # three pictures, each through the vision tower once
    # The lean step and the model's own forward: the same tokens, log-probs to float rounding.
    assert [r.token_ids for r in results[True]] == [r.token_ids for r in results[False]]
    worst = max(abs(a - b) for x, y in zip(results[True], results[False]) for a, b in zip(x.logprobs, y.logprobs))
    assert worst < TOL


def test_a_picture_seen_again_after_a_weight_update_is_encoded_by_the_new_weights(vlm):
    d, tok, vision = vlm
    engine = TorchEngine(load_model(d), tok.pad_token_id, vision=vision)
    red, blue, green = picture("red", "small"), picture("blue", "wide"), picture("green", "square")
    first = [request("a", *user_turn(tok, vision, red, "What color?"), tok),
             request("b", *user_turn(tok, vision, "Count:", blue), tok, temperature=1.0, seed=2)]
    engine.generate_sync(first)
    assert engine.images_encoded == 2 and len(engine.features) == 2

    new = load_model(d)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # the trainer's next weights: every parameter moved, the vision tower's too
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    engine.update_weights(1, {n: p.detach().clone() for n, p in new.named_parameters()})

    second = [request("a2", *user_turn(tok, vision, red, "What color is it?"), tok),  # red again
              request("c", *user_turn(tok, vision, green, "and", blue), tok, temperature=1.0, seed=3),
              request("d", *user_turn(tok, vision, "no picture"), tok)]
    results = engine.generate_sync(second)
    assert all(r.version == 1 for r in results)
    worst = worst_vs_teacher(new, vision, second, results)
    assert worst < TOL, f"after the update, log-probs differ from the new weights' teacher forcing by {worst:.3g}"
    assert engine.images_encoded == 2 + 3  # red and blue, seen before the update, went through the new tower

    # The check has teeth: red's features from the old vision tower (what a cache kept across the
    # update would serve), with the new language model, give log-probs off by far more than TOL.
    stale = load_model(d)
    stale.load_state_dict({n: p for n, p in new.state_dict().items() if ".visual." not in n}, strict=False)
    off = float((teacher(stale, vision, second[0], results[0]) - torch.tensor(results[0].logprobs)).abs().max())
    assert off > 100 * TOL, f"the old vision tower's features change the log-probs by only {off:.3g}"


def test_a_sessions_second_turn_with_a_new_picture_prefills_only_what_is_new(vlm):
    d, tok, vision = vlm
    engine = TorchEngine(load_model(d), tok.pad_token_id, vision=vision)
    model = load_model(d)
    red, blue, green, purple = (picture("red", "small"), picture("blue", "wide"), picture("green", "square"),
                                picture("purple", "small"))
    # s1's picture ends its prompt, a few tokens before its cached tokens end: joining s0, whose new part
    # is longer, s1 re-feeds cached tokens up to s0's length, the end of that picture's run among them.
    turn1 = {"s0": user_turn(tok, vision, red, "What color is the big square?"),
             "s1": user_turn(tok, vision, "What color?", blue),
             "s2": user_turn(tok, vision, red, "zero one two three four five six seven eight nine 0 1 2 3 4 5 6 7 8 9")}
    reqs1 = [request(f"{s}-1", ids, blobs, tok, max_new_tokens=4, session=s) for s, (ids, blobs) in turn1.items()]
    out1 = engine.generate_sync(reqs1)
    assert len(engine.prefixes) == 3 and engine.images_encoded == 2

    more = {"s0": user_turn(tok, vision, "Now this one:", green, "Same color?", first=False),
            "s1": user_turn(tok, vision, "ok", first=False),
            # s2 shows a different picture of red's size in its first turn: the same tokens, other pixels
            "s2": user_turn(tok, vision, "ok", first=False)}
    reqs2 = []
    for q, r in zip(reqs1, out1):
        s = q.session_id
        ids, blobs = more[s]
        old = list(q.images) if s != "s2" else [purple]
        reqs2.append(request(f"{s}-2", q.prompt_ids + r.token_ids + ids, old + blobs, tok, max_new_tokens=6,
                             session=s, temperature=1.0, seed=5))
    fed_before, encoded_before, hits_before = engine.prefill_tokens, engine.images_encoded, engine.prefixes.hits
    out2 = engine.generate_sync(reqs2)
    worst = worst_vs_teacher(model, vision, reqs2, out2)
    assert worst < TOL, f"turn 2 log-probs differ from teacher forcing by {worst:.3g}"


    # s0 and s1 found their prefixes; s2's did not match its pictures and was fed whole.
    assert engine.prefixes.hits - hits_before == 2
    cached = {q.session_id: len(q.prompt_ids) + len(r.token_ids) - 1 for q, r in zip(reqs1, out1)}
    new = {q.session_id: len(q.prompt_ids) - cached[q.session_id] for q in reqs2}
    longest = max(new["s0"], new["s1"])
    assert longest == new["s0"]
    s1 = reqs2[1]
    (start, end), = vision.runs(s1.prompt_ids)
    first_fed = len(s1.prompt_ids) - longest
    assert start < first_fed < end, "s1 must re-feed part of its picture's run for this test to check that"
    (_, end), = vision.runs(reqs2[2].prompt_ids)
    assert end < cached["s2"] + new["s2"] - longest, "s2's picture must lie in the cached part it would not re-feed"
    expected = longest + longest + len(reqs2[2].prompt_ids)
    assert engine.prefill_tokens - fed_before == expected
    # green and purple are new; blue's features (s1's re-fed run) came from the cache.
    assert engine.images_encoded - encoded_before == 2


def test_vision_tokens_are_never_sampled(vlm):
    d, tok, vision = vlm
    model = load_model(d)
    banned = list(vision.banned_token_ids)
    emb = model.get_input_embeddings().weight  # tied to the output layer
    with torch.no_grad():
        # A large constant last component in every embedding rides the residual stream to the last
        # position, where the output layer's last column then favours the vision tokens' 3x larger one.
        emb[:, -1] = 2.0
        emb[banned, -1] = 6.0
    reqs = mixed_batch(tok, vision)
    engine = TorchEngine(model, tok.pad_token_id, vision=vision)
    greedy_reqs = [request(q.request_id, q.prompt_ids, q.images, tok, max_new_tokens=8) for q in reqs]
    sampled_reqs = [request(q.request_id, q.prompt_ids, q.images, tok, temperature=1.0, seed=s, max_new_tokens=8)
                    for s in range(4) for q in reqs]
    greedy, sampled = engine.generate_sync(greedy_reqs), engine.generate_sync(sampled_reqs)
    produced = {t for r in greedy + sampled for t in r.token_ids}
    assert not produced & set(banned), f"vision tokens sampled: {produced & set(banned)}"
    for q, r in zip(greedy_reqs, greedy):  # without the mask, the model's argmax is a vision token everywhere
        ids = q.prompt_ids + r.token_ids
        kw = {}
        if q.images:
            pv, grid = vision.pixels(list(q.images))
            kw = {"pixel_values": pv, "image_grid_thw": grid}
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), position_ids=vision.positions(ids, list(q.images))[:, None],
                           **kw).logits[0, len(q.prompt_ids) - 1:-1]
        assert set(logits.argmax(-1).tolist()) <= set(banned)
    # The log-probs are those of the masked distribution: unmasked, the vision tokens hold almost all
    # of the mass, and every generated token's log-prob is far lower.
    assert worst_vs_teacher(model, vision, greedy_reqs, greedy) < TOL
    assert worst_vs_teacher(model, vision, sampled_reqs, sampled) < TOL
    gap = min(float((teacher(model, vision, q, r) - teacher(model, vision, q, r, masked=False)).min())
              for q, r in zip(greedy_reqs + sampled_reqs, greedy + sampled))
    assert gap > 1.0, f"the mask changes a log-prob by only {gap:.3g}: the vision tokens were not favoured"


def test_requests_whose_images_do_not_fit_are_refused(vlm, tiny_model_dir, tokenizer):
    d, tok, vision = vlm
    red, blue = picture("red", "small"), picture("blue", "wide")
    ids, _ = user_turn(tok, vision, red, "What color?")
    text_engine = TorchEngine(load_model(tiny_model_dir), tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="request pic carries 1 image.*text-only"):
        text_engine.generate_sync([request("pic", [5, 6, 7], [red], tok)])
    engine = TorchEngine(load_model(d), tok.pad_token_id, vision=vision)
    with pytest.raises(ValueError, match=r"request two: its prompt has 1 run\(s\) of image pads .* 2 image"):
        engine.generate_sync([request("two", ids, [red, blue], tok)])
    with pytest.raises(ValueError, match=r"request none: its prompt has 1 run\(s\) .* 0 image"):
        engine.generate_sync([request("none", ids, [], tok)])
    with pytest.raises(ValueError, match="request wide: image 0 .* takes 8 image tokens but its run .* has 4"):
        engine.generate_sync([request("wide", ids, [blue], tok)])
    with pytest.raises(ValueError, match="request raw: images must be tidal.images.ImageBlob"):
        engine.generate_sync([request("raw", ids, [red.pil()], tok)])
    assert engine.decode_steps == 0  # refused before anything ran


def test_build_engine_gives_the_torch_engine_the_models_vision(vlm):
    d, tok, _ = vlm
    engine = build_engine("torch", EngineConfig(kind="torch"), d, dtype="float32", device="cpu",
                          pad_token_id=tok.pad_token_id)
    assert engine.vision is not None and engine.vision.banned_token_ids == Vision.load(d).banned_token_ids
    text = build_engine("torch", EngineConfig(kind="torch"), DEFAULT_MODEL_DIR, dtype="float32", device="cpu",
                        pad_token_id=0)
    assert text.vision is None
