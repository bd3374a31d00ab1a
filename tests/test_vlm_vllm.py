"""vLLM with a vision-language model (the tiny Qwen2-VL, random weights, fp32) through tidal's Engine
protocol: log-probs equal a teacher-forced transformers forward over prompt + generation with the same
pictures, mRoPE positions (`vision.positions`) and the vision special tokens masked; after a weight
update too, a picture seen before it among the requests (vLLM fails with "Encoder cache miss" there
unless its encoder cache is reset); vLLM is given one pad per image and expands it to exactly tidal's
runs; vision special tokens are never sampled; server mode over HTTP.

The random model is sharpened (its text side: tests/vlm_checks.py) so that what is checked shows in
the log-probs.

Skipped only where vLLM is not installed and TIDAL_REQUIRE_VLLM is unset (as tests/test_vllm_engine.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time

import pytest
import torch
from PIL import Image, ImageDraw

from tests.vlm_checks import sharpened_vlm
from tidal.algorithms import token_logprobs
from tidal.images import as_image
from tidal.models import load_model, load_tokenizer, stop_token_ids
from tidal.models.vision import Vision, mask_banned
from tidal.types import GenerationRequest, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None and not os.environ.get("TIDAL_REQUIRE_VLLM"):
    pytest.skip("vLLM is not installed (`make setup-vllm`); set TIDAL_REQUIRE_VLLM=1 to fail instead",
                allow_module_level=True)

# fp32, the same weights, two computations of one log-prob: vLLM (its own image processor, vision
# tower, mRoPE and paged attention) vs one teacher-forced transformers forward of the whole sequence.
# Measured here <= 1e-6 (docs/multimodal.md: 1e-6); 1e-4 leaves 100x for another CPU's kernels. What it
# catches moves log-probs by far more: 1-D positions instead of mRoPE, the old vision tower's
# features after an update, an unmasked vision token (each asserted below to exceed 100 x TOL).
TOL = 1e-4
# Pictures of sizes tidal's processor resizes differently: 4, 8, 9, 15 image tokens; 20x20 is scaled
# up to min_pixels (4 tokens), 400x300 down to max_pixels (54), 280x42 keeps its aspect ratio (20).
SIZES = {"small": (56, 56), "wide": (100, 60), "square": (84, 84), "tall": (90, 150), "tiny": (20, 20),
         "big": (400, 300), "strip": (280, 42)}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    d = sharpened_vlm(tmp_path_factory.mktemp("vlm") / "model", vision=False)  # module docstring
    return str(d), load_tokenizer(d), Vision.load(d)


@pytest.fixture(scope="module")
def engine(vlm):
    """One in-process engine for the module, built and used with torch at 1 thread (see
    tests/test_vllm_engine.py). `engine.received` records the prompts vLLM's renderer is given."""
    from tidal.engines.vllm_engine import VLLMEngine

    d, _, vision = vlm
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    eng = VLLMEngine(d, mode="in_process", dtype="float32", vision=vision)
    eng.start_s = time.perf_counter() - start
    print(f"\nvLLM in-process engine with the tiny VLM started in {eng.start_s:.1f} s")
    renderer = eng._backend.llm.llm_engine.renderer
    render, eng.received = renderer.render_cmpl, []

    def recording(prompts, *args, **kwargs):
        eng.received.extend(prompts)
        return render(prompts, *args, **kwargs)

    renderer.render_cmpl = recording
    yield eng
    eng.close()
    torch.set_num_threads(before)


def picture(color: str, size: str):
    w, h = SIZES[size]
    img = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(img).rectangle((4, 6, w // 2 + 9, h // 2 + 3), fill=color)
    return as_image(img)


def user_turn(tok, vision, *parts) -> tuple[list[int], list]:
    """Token ids of a user message (text and pictures, in order) and the generation prompt, images
    expanded by tidal (what the rollout gives an engine)."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                   tokenize=False)
    blobs = [p for p in parts if not isinstance(p, str)]
    return vision.expand(tok(text, add_special_tokens=False)["input_ids"], blobs), blobs


def request(name: str, ids: list[int], images, tok, *, temperature=0.0, seed=0, max_new_tokens=12):
    return GenerationRequest(name, list(ids), SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                             seed=seed, stop_token_ids=stop_token_ids(tok)),
                             images=tuple(images))


def teacher(model, vision, req, result, masked: bool = True, mrope: bool = True) -> torch.Tensor:
    """log softmax(logits / T) of each generated token from one forward of the model over prompt +
    generation with the request's pictures (T = 1 when greedy), the vision tokens masked."""
    ids = req.prompt_ids + result.token_ids
    kw = {}
    if req.images:
        pixel_values, grid = vision.pixels(list(req.images))
        kw = {"pixel_values": pixel_values, "image_grid_thw": grid}
    positions = vision.positions(ids, list(req.images)) if mrope else torch.arange(len(ids)).expand(3, -1)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), position_ids=positions[:, None], **kw).logits[:, :-1]
    if masked:
        logits = mask_banned(logits, vision.banned_token_ids)
    t = req.params.temperature if req.params.temperature > 0 else 1.0
    return token_logprobs(logits, torch.tensor([ids[1:]]), t)[0, len(req.prompt_ids) - 1:]


def worst_vs_teacher(model, vision, reqs, results, **kw) -> float:
    return max(float((teacher(model, vision, q, r, **kw) - torch.tensor(r.logprobs)).abs().max())
               for q, r in zip(reqs, results, strict=True))


def mixed_batch(tok, vision, tag="r") -> list[GenerationRequest]:
    """Rows with no picture, one picture of each size, two pictures, a picture last, a picture two
    rows share; greedy and sampled at two temperatures."""
    red, blue, green = picture("red", "small"), picture("blue", "wide"), picture("green", "square")
    turns = [
        user_turn(tok, vision, red, "What color is the big square?"),
        user_turn(tok, vision, "How many red squares are there?"),
        user_turn(tok, vision, blue, "left or right", green, "top"),
        user_turn(tok, vision, "zero one two three four five six seven eight nine", picture("gray", "tall")),
        user_turn(tok, vision, blue, "What color?"),
        user_turn(tok, vision, "one", red, "two", blue, "three", green),
    ]
    return [request(f"{tag}{i}", ids, blobs, tok, temperature=(0.0, 1.0, 0.7)[i % 3], seed=10 + i,
                    max_new_tokens=6 + 2 * i) for i, (ids, blobs) in enumerate(turns)]


def test_logprobs_equal_teacher_forcing_and_vllm_gets_one_pad_per_image(engine, vlm):
    d, tok, vision = vlm
    reqs = mixed_batch(tok, vision)
    engine.received.clear()
    results = run(engine.generate(reqs))
    model = load_model(d)
    worst = worst_vs_teacher(model, vision, reqs, results)
    print(f"max |engine - teacher| log-prob, {sum(len(r.token_ids) for r in results)} tokens: {worst:.3g}")
    assert worst < TOL, f"vLLM log-probs differ from teacher forcing by {worst:.3g}"
    # The checks have teeth: 1-D positions, or the vision tokens left in the distribution, move them far more.
    assert worst_vs_teacher(model, vision, reqs, results, mrope=False) > 100 * TOL
    assert worst_vs_teacher(model, vision, reqs, results, masked=False) > 100 * TOL

    # What vLLM was given: the prompt with each image run collapsed to one pad, and the pictures.
    pad = vision.image_token_id
    assert len(engine.received) == len(reqs)
    for q, got in zip(reqs, engine.received, strict=True):
        ids = got["prompt_token_ids"]
        assert ids == vision.collapse(q.prompt_ids)
        assert ids.count(pad) == len(q.images) and all(e - s == 1 for s, e in vision.runs(ids))
        if q.images:
            assert [im.size for im in got["multi_modal_data"]["image"]] == [(b.width, b.height) for b in q.images]
            assert got["multi_modal_uuids"]["image"] == [b.id for b in q.images]
        else:
            assert "multi_modal_data" not in got


def test_vllm_expands_each_picture_to_tidals_run(engine, vlm):
    """vLLM's processor (built by vLLM from preprocessor_config.json) resizes each picture as tidal's
    does: every answer's expanded prompt equals the request's, token for token (the engine checks
    it and fails the call otherwise), over sizes that are scaled up, down and kept."""
    _, tok, vision = vlm
    pics = [picture(c, s) for c, s in zip(("red", "blue", "green", "gray", "purple", "orange", "black"), SIZES)]
    assert [vision.num_tokens(p) for p in pics] == [4, 8, 9, 15, 4, 54, 20]
    reqs = [request(f"size{i}", *user_turn(tok, vision, "Which color?", p), tok, max_new_tokens=2)
            for i, p in enumerate(pics)]
    reqs.append(request("all", *user_turn(tok, vision, *pics), tok, max_new_tokens=2))
    results = run(engine.generate(reqs))
    assert all(len(r.token_ids) == 2 for r in results)


def test_an_image_run_that_does_not_fit_its_picture_is_refused(engine, vlm):
    from tidal.engines.vllm_engine import VLLMEngineError

    _, tok, vision = vlm
    ids, blobs = user_turn(tok, vision, "What color?", picture("red", "small"))
    collapsed = vision.collapse(ids)  # one pad where the 56x56 picture needs its run of 4
    with pytest.raises(VLLMEngineError, match=r"request short: image runs of \[1\] tokens .* of \[4\] tokens"):
        run(engine.generate([request("short", collapsed, blobs, tok)]))


def test_banned_tokens_are_never_sampled(engine, vlm):
    """Sampled at T = 1.5 the model puts noticeable mass on the vision tokens: summed over the 2304
    tokens drawn, the expected number of them without the ban is ~21 (asserted > 10: the chance of
    drawing none unbanned is then below e^-10). None is drawn."""
    d, tok, vision = vlm
    banned = set(vision.banned_token_ids)
    base = mixed_batch(tok, vision, tag="b")
    reqs = [GenerationRequest(f"{q.request_id}-{k}", q.prompt_ids, SamplingParams(
        max_new_tokens=48, temperature=1.5, seed=100 + 8 * i + k), images=q.images)
        for i, q in enumerate(base) for k in range(8)]
    results = run(engine.generate(reqs))
    drawn = [t for r in results for t in r.token_ids]
    assert not banned & set(drawn)
    model = load_model(d)
    expected = 0.0  # Σ over drawn tokens of the unmasked probability of a vision token at that step
    for q, r in zip(reqs, results, strict=True):
        ids = q.prompt_ids + r.token_ids
        kw = {}
        if q.images:
            pixel_values, grid = vision.pixels(list(q.images))
            kw = {"pixel_values": pixel_values, "image_grid_thw": grid}
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), position_ids=vision.positions(ids, list(q.images))[:, None],
                           **kw).logits[0, len(q.prompt_ids) - 1:-1]
        expected += float(torch.softmax(logits / 1.5, -1)[:, sorted(banned)].sum())
    print(f"{len(drawn)} tokens drawn; expected vision tokens among them without the ban: {expected:.1f}")
    assert expected > 10


def test_weight_update_then_a_picture_seen_before(engine, vlm):
    """Perturbed weights (the vision tower's too) sent as the trainer's named_parameters (tied
    head left out: the engine adds lm_head.weight); afterwards a picture the engine has encoded
    before the update: its features must come from the new vision tower (vLLM would otherwise
    fail with "Encoder cache miss" or reuse the old ones)."""
    d, tok, vision = vlm
    red, blue, green = picture("red", "small"), picture("blue", "wide"), picture("green", "square")
    first = [request("u0", *user_turn(tok, vision, red, "What color?"), tok),
             request("u1", *user_turn(tok, vision, "Count:", blue), tok, temperature=1.0, seed=2)]
    run(engine.generate(first))

    new = load_model(d)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # the trainer's next weights: every parameter moved, the vision tower's too
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    named = {n: p.detach().clone() for n, p in new.named_parameters()}
    assert any(n.startswith("model.visual.") for n in named) and "lm_head.weight" not in named
    engine.update_weights(1, named)

    second = [request("v0", *user_turn(tok, vision, red, "What color is it?"), tok),  # red again
              request("v1", *user_turn(tok, vision, green, "and", blue), tok, temperature=1.0, seed=3),  # blue again
              request("v2", *user_turn(tok, vision, "no picture"), tok, temperature=0.7, seed=4)]
    results = run(engine.generate(second))
    assert all(r.version == 1 for r in results)
    worst = worst_vs_teacher(new, vision, second, results)
    print(f"after the update: max |engine - teacher| log-prob {worst:.3g}")
    assert worst < TOL, f"after the update, log-probs differ from the new weights' teacher forcing by {worst:.3g}"
    # The check has teeth: red's features from the old vision tower with the new language model.
    stale = load_model(d)
    stale.load_state_dict({n: p for n, p in new.state_dict().items() if ".visual." not in n}, strict=False)
    off = float((teacher(stale, vision, second[0], results[0]) - torch.tensor(results[0].logprobs)).abs().max())
    assert off > 100 * TOL, f"the old vision tower's features change the log-probs by only {off:.3g}"
    # The same requests again: vLLM's caches (prefix, encoder) now hold the new weights' work.
    again = run(engine.generate(second))
    assert [r.token_ids for r in again] == [r.token_ids for r in results]


def test_server_mode_with_images(engine, vlm, tmp_path):
    """The supervised server: requests with images through /inference/v1/generate (token ids and
    the pictures), sampling what the in-process engine samples with the same seeds; a weight update
    over HTTP, then a picture seen before it."""
    from tidal.engines.vllm_engine import VLLMEngine

    d, tok, vision = vlm
    engine.update_weights(0, {n: p.detach().clone() for n, p in load_model(d).named_parameters()})
    reqs = mixed_batch(tok, vision, tag="s")
    server = VLLMEngine(d, mode="server", dtype="float32", log_dir=tmp_path, start_timeout_s=300, vision=vision)
    try:
        got = run(server.generate(reqs))
        want = run(engine.generate(reqs))
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs)) < TOL

        new = load_model(d)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in new.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        server.update_weights(2, {n: p.detach().clone() for n, p in new.named_parameters()})
        after = run(server.generate(reqs))  # every picture seen before the update
        assert all(r.version == 2 for r in after)
        worst = worst_vs_teacher(new, vision, reqs, after)
        print(f"server after the update: max |engine - teacher| log-prob {worst:.3g}")
        assert worst < TOL
    finally:
        server.close()
