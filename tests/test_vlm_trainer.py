"""The Trainer with a vision-language model (the tiny Qwen2-VL): images in the batch, mRoPE positions,
the vision special tokens masked out of the policy, split invariance with images (1 vs several
micro-batches, 2 FSDP ranks with an image-free shard vs one process), packing with images, LoRA,
and build_batch giving each segment its images.

Sequences are built from token ids directly: a run of image pads per image (as `Vision.expand` makes
it) between <|vision_start|> and <|vision_end|>, text tokens drawn from ids that are not vision
tokens. Images are PIL pictures drawn here, of three sizes (4, 8 and 9 image tokens)."""

from __future__ import annotations

import math
import os
import random
import socket
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
from PIL import Image, ImageDraw
from test_trainer import GRAD_TOL

from tidal.config import AlgorithmConfig, LoraConfig, TrainConfig
from tidal.images import as_image
from tidal.models import load_model, resolve_model_dir
from tidal.models.vision import Vision, image_processor, image_runs
from tidal.recipes.tiny_vlm import build_untrained_vlm
from tidal.runtime.batch import build_batch
from tidal.trainer.layout import micro_batches, pack_rows, packed_inputs, packed_order
from tidal.trainer.trainer import TrainBatch, Trainer
from tidal.types import Episode

SIZES = [(56, 56), (100, 60), (84, 84)]  # grids (1,4,4), (1,4,8), (1,6,6): 4, 8 and 9 image tokens
COLORS = ["red", "green", "blue", "yellow", "purple"]
IMAGE_COUNTS = [0, 1, 2, 1, 0, 2, 1, 0]  # per sequence of `_batch`


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    d = build_untrained_vlm(tmp_path_factory.mktemp("vlm") / "model")
    return str(d), Vision.load(d)


def picture(color: str, size: tuple[int, int]):
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle((4, 6, size[0] // 2 + 9, size[1] // 2 + 3), fill=color)
    return as_image(img)


def _text_ids(vision: Vision) -> list[int]:
    return [i for i in range(10, 300) if i not in vision.banned_token_ids]


def image_tokens(vision: Vision, blob) -> list[int]:
    s = vision.spec
    return [s.vision_start_token_id, *[s.image_token_id] * vision.num_tokens(blob), s.vision_end_token_id]


def _sequence(rng, vision, blobs, answer: int):
    """Prompt (text, then each image followed by a little text) and a policy answer of `answer` tokens."""
    text = _text_ids(vision)
    toks = [rng.choice(text) for _ in range(3)]
    for b in blobs:
        toks += image_tokens(vision, b) + [rng.choice(text) for _ in range(2)]
    mask = [False] * len(toks) + [True] * answer
    return toks + [rng.choice(text) for _ in range(answer)], mask


def _batch(vision, counts=IMAGE_COUNTS, seed=0) -> TrainBatch:
    rng = random.Random(seed)
    tokens, masks, images, behav, old = [], [], [], [], []
    for k, n in enumerate(counts):
        blobs = [picture(COLORS[(k + j) % len(COLORS)], SIZES[(k + 2 * j) % len(SIZES)]) for j in range(n)]
        t, m = _sequence(rng, vision, blobs, rng.randint(2, 6))
        tokens.append(t)
        masks.append(m)
        images.append(blobs)
        behav.append([rng.uniform(-6.5, -5.5) if x else 0.0 for x in m])
        old.append([rng.uniform(-6.5, -5.0) for _ in t[1:]])  # perturbed: some ratios clip
    adv = [[rng.uniform(-1.5, 1.5) if x else 0.0 for x in m[1:]] for m in masks]
    return TrainBatch(tokens, masks, adv, behav, old, images=images)


def _trainer(model_dir, budget=10_000, packing=False, lora=0, **algo) -> Trainer:
    torch.manual_seed(0)  # LoRA's A matrices
    return Trainer(model_dir, TrainConfig(micro_batch_tokens=budget, packing=packing, lora=LoraConfig(rank=lora)),
                   AlgorithmConfig(**algo), pad_token_id=0)


def _grads(model) -> dict[str, torch.Tensor]:
    from tidal.trainer.distributed import full_tensor

    return {n: full_tensor(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got: dict, want: dict, what: str, **tol):
    assert got.keys() == want.keys(), what
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, **(tol or GRAD_TOL), msg=lambda m, n=n: f"{what} {n}: {m}")


def _vision_grad(grads: dict) -> float:
    return sum(float(g.abs().sum()) for n, g in grads.items() if ".visual." in n)


# -- one process ---------------------------------------------------------------------------
# One aggregation: the denominators do not depend on images, and every aggregation's split invariance is
# tested on text (tests/test_trainer.py); this test is about images, pixels and positions per micro-batch.
@pytest.mark.parametrize("agg", ["token-mean"])
def test_gradients_with_images_do_not_depend_on_the_micro_batch_split(vlm, agg):
    """1 micro-batch vs 4+, on one batch of sequences with 0, 1 and 2 images of 3 sizes (each
    micro-batch gets its own images, pixels and positions). GRAD_TOL's reason holds here too:
    the same sums in another order (padding widths and the vision tower's batch of images change);
    measured ≤ 3.0e-7 on gradients up to 0.93, at most 4.2e-8 over the rtol part, against atol 1e-6."""
    d, vision = vlm
    b = _batch(vision)
    lengths = [len(t) for t in b.tokens]
    out = {}
    for budget in (10_000, 60):
        tr = _trainer(d, budget, loss_agg=agg, kl_coef=0.1)
        m = tr.forward_backward(b)
        out[budget] = (_grads(tr.model), m, len(micro_batches(lengths, budget)))
    (whole, m1, n1), (split, m4, n4) = out[10_000], out[60]
    assert n1 == 1 and n4 >= 4, (n1, n4)
    # the images matter: the vision tower has a gradient, and each micro-batch with images ran it
    assert _vision_grad(whole) > 0 and whole.keys() == {n for n, _ in tr.model.named_parameters()}
    _close(split, whole, f"{agg} gradient, 4+ vs 1 micro-batches")
    assert m4["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-7)  # as GRAD_TOL
    assert m1["clip_frac"] > 0 and m1["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference


def _reference_logprobs(model, processor, vision, tokens: list[int], blobs, bonus=None) -> tuple[torch.Tensor, ...]:
    """An independent teacher-forced forward of one sequence: transformers' image processor and its
    own `get_rope_index` for the positions, then log_softmax over the vocabulary without the vision
    tokens (their logits -inf). Returns (log-probs of the targets, entropy per position, log-probs of
    the targets WITHOUT the mask)."""
    ids = torch.tensor([tokens])
    kw = {}
    if blobs:
        px = processor(images=[b.pil() for b in blobs], return_tensors="pt")
        kw = {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"]}
        pos, _ = model.model.get_rope_index(ids, (ids == vision.image_token_id).int(),
                                            image_grid_thw=px["image_grid_thw"])
    else:
        pos = torch.arange(len(tokens)).view(1, 1, -1).expand(3, 1, -1)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kw).logits[0, :-1]
    if bonus is not None:
        logits = logits + bonus
    target = ids[0, 1:, None]
    raw = logits.log_softmax(-1).gather(-1, target).squeeze(-1)
    logits[:, list(vision.banned_token_ids)] = float("-inf")
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    return logp.gather(-1, target).squeeze(-1), entropy, raw


def _assert_logprobs(got: list[float], want: torch.Tensor) -> None:
    """`got` (the trainer's) equals `want` where the target may be sampled; where the target is a
    vision token (the image runs of the prompt) `want` is -inf and the trainer's ~ -1e9 (finite)."""
    got_t, banned = torch.tensor(got), torch.isinf(want)
    assert bool((got_t[banned] < -1e8).all())
    torch.testing.assert_close(got_t[~banned], want[~banned], rtol=0, atol=1e-4)


def test_trainer_logprobs_equal_an_independent_teacher_forced_forward(vlm):
    """`logprobs()` (sequences padded together, several micro-batches, positions from Vision) against
    each sequence alone through transformers' own path. fp32, the same model: the difference is
    summation order in padded batches (measured ≤ 4.8e-7 on log-probs of about -6); 1e-4 is 200x
    that, while other pictures move them by more than 1e-2 (the control below)."""
    d, vision = vlm
    b = _batch(vision)
    tr = _trainer(d, budget=70)
    got = tr.logprobs(b)
    model, processor = load_model(d).eval(), image_processor(d)
    for toks, blobs, lp in zip(b.tokens, b.images, got):
        _assert_logprobs(lp, _reference_logprobs(model, processor, vision, toks, blobs)[0])
    # the control: the pictures do enter the log-probs (another colour, the same size and positions)
    k = IMAGE_COUNTS.index(1)
    other = b.select([k])
    other.images = [[picture("black", other.images[0][0].pil().size)]]
    moved = torch.tensor(tr.logprobs(other)[0]) - torch.tensor(got[k])
    assert moved.abs().max() > 1e-2


def test_banned_vision_tokens_are_masked_in_every_trainer_forward(vlm, monkeypatch):
    """Logits that favour a vision token by +30 (added where the trainer's output head forms each
    chunk's logits, before the masking): the trainer's log-probs and entropy are those of the
    distribution without the vision tokens (-inf in the reference), not those of the raw logits,
    which put nearly all mass on the vision token."""
    from tidal.trainer.parallel import logprob

    d, vision = vlm
    b = _batch(vision, counts=[0, 1, 2])
    bonus = torch.zeros(load_model(d).config.text_config.vocab_size)
    bonus[vision.image_token_id] = 30.0
    chunk_logits = logprob._chunk_logits

    def favoured(h, w, temperature, banned):
        z = chunk_logits(h, w, temperature, None) + bonus.to(h.device) / temperature
        return z if banned is None else z.index_fill(-1, banned, -1e9)

    monkeypatch.setattr(logprob, "_chunk_logits", favoured)
    tr = _trainer(d, kl_coef=0.1, entropy_coef=0.01)
    got = tr.logprobs(b)
    ref = tr.ref_logprobs(b)  # the reference's forward: favoured alike, masked alike
    m = tr.forward_backward(b)
    model, processor = load_model(d).eval(), image_processor(d)
    ent, n = 0.0, 0
    for toks, blobs, mask, lp, rlp in zip(b.tokens, b.images, b.loss_mask, got, ref):
        want, entropy, raw = _reference_logprobs(model, processor, vision, toks, blobs, bonus)
        # as the previous test: summation order only
        _assert_logprobs(lp, want)
        _assert_logprobs(rlp, want)
        free = ~torch.isinf(want)
        assert (want - raw)[free].min() > 10  # unmasked, the favoured vision token takes the mass
        at = torch.tensor(mask[1:])
        ent, n = ent + float(entropy[at].sum()), n + int(at.sum())
    assert m["entropy"] == pytest.approx(ent / n, rel=1e-4)  # finite, the masked distribution's
    # a banned target scores ~ -1e9: finite (no NaN into losses), and never the policy's token
    toks = list(b.tokens[0])
    toks[-1] = vision.spec.vision_end_token_id
    lp = tr.logprobs(TrainBatch([toks], [b.loss_mask[0]], [b.advantages[0]], [b.behaviour_logprobs[0]]))[0][-1]
    assert -2e9 < lp < -1e8


def test_share_prompts_is_refused_for_a_vlm(vlm):
    """A picture's positions and pixels are laid out per sequence: one shared copy of a prompt
    with pictures is not built, and the option says so before any model loads."""
    with pytest.raises(ValueError, match="train.share_prompts is for text models"):
        Trainer(vlm[0], TrainConfig(share_prompts=True), AlgorithmConfig(), pad_token_id=0)


def test_packing_with_images_equals_the_padded_path(vlm):
    """`train.packing` with images: position ids [4, rows, S] (text positions first, from which
    Qwen2-VL builds the packed mask), pixels in packed order. Gradients, loss and log-probs equal the
    padded path's (GRAD_TOL: summation order; measured ≤ 1.8e-7 on gradients up to 0.93, log-probs
    identical)."""
    d, vision = vlm
    b = _batch(vision)
    out = {}
    for packing in (False, True):
        tr = _trainer(d, budget=120, packing=packing, loss_agg="seq-mean-token-sum", kl_coef=0.1)
        m = tr.forward_backward(b)
        out[packing] = (_grads(tr.model), m, tr.logprobs(b))
    (g0, m0, lp0), (g1, m1, lp1) = out[False], out[True]
    _close(g1, g0, "packed vs padded gradient")
    assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-4, abs=1e-7)
    for a, c in zip(lp1, lp0):  # log-probs of an fp32 model: summation order only
        torch.testing.assert_close(torch.tensor(a), torch.tensor(c), rtol=0, atol=1e-4)
    # rows hold several sequences (else packing would prove nothing)
    assert len(pack_rows([len(t) for t in b.tokens], max(len(t) for t in b.tokens))) < len(b)


def test_without_text_positions_packed_sequences_with_images_would_see_each_other(vlm):
    """The control of the equality above: the same packed rows given only the three mRoPE rows (no
    text positions: no packed mask) change the logits of every sequence not first in its row."""
    d, vision = vlm
    b = _batch(vision)
    model = load_model(d).eval()
    rope = [vision.positions(t, im) for t, im in zip(b.tokens, b.images)]
    ids, pos, index = packed_inputs(b.tokens, 0, rope=rope)
    assert pos.shape[0] == 4
    pv, grid = vision.pixels([blob for i in packed_order([len(t) for t in b.tokens]) for blob in b.images[i]])
    with torch.no_grad():
        run = lambda p: model(input_ids=ids, position_ids=p, pixel_values=pv, image_grid_thw=grid,
                              use_cache=False).logits.flatten(0, 1)[index]
        right, wrong = run(pos), run(pos[1:])
    rows = pack_rows([len(t) for t in b.tokens], max(len(t) for t in b.tokens))
    later = [i for r in rows for i in r[1:]]
    assert later
    for i in later:
        n = len(b.tokens[i]) - 1
        assert (right[i, :n] - wrong[i, :n]).abs().max() > 1e-2


def test_lora_on_a_vlm_adapts_the_language_model_and_merges_every_key(vlm, tmp_path, monkeypatch):
    """The default targets name the language model's projections: only their adapters train (the
    vision tower stays frozen), the merged weights carry every parameter of the plain model under
    its own name, and the checkpoint's model/ is a whole VLM directory (image processor included)."""
    d, vision = vlm
    tr = _trainer(d, lora=4, kl_coef=0.1)
    trainable = [n for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".language_model." in n for n in trainable)
    b = _batch(vision)
    m = tr.forward_backward(b)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)  # B = 0: the adapted model is the base
    tr.optim_step()
    merged = tr.named_weights()
    base = dict(load_model(d).named_parameters())
    assert merged.keys() == base.keys()
    changed = {n for n in base if not torch.equal(merged[n], base[n].detach())}
    assert changed and all(".language_model." in n and n.endswith("_proj.weight") for n in changed)
    tr.save(tmp_path / "ck")
    assert Vision.load(tmp_path / "ck" / "model") is not None  # preprocessor_config.json came along
    saved = dict(load_model(tmp_path / "ck" / "model").named_parameters())
    _close({n: p.detach() for n, p in saved.items()}, merged, "saved merged weight", rtol=0, atol=0)
    # `tidal eval <checkpoint>/adapter`: the adapter merged into its VLM base is a whole VLM directory too
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    merged_dir = resolve_model_dir(tmp_path / "ck" / "adapter")
    assert merged_dir.is_relative_to(tmp_path / "cache") and Vision.load(merged_dir) is not None
    again = dict(load_model(merged_dir).named_parameters())
    # peft's merge (W + scale·B·A in its own order) against tidal's: the same sum up to float32 rounding of
    # weights of magnitude ~0.1 (1e-6 is ~100 ulps there).
    _close({n: p.detach() for n, p in again.items()}, merged, "merged adapter dir weight", rtol=0, atol=1e-6)


def test_a_checkpoint_of_a_vlm_resumes_and_serves_as_a_model(vlm, tmp_path):
    """model/ holds the weights under the names transformers publishes Qwen2-VL in (`visual.*`,
    `model.layers.*`) and the image processor's settings: the trainer resumes from it exactly, and
    it loads as a model directory of its own."""
    d, vision = vlm
    b = _batch(vision)
    tr = _trainer(d)
    tr.forward_backward(b)
    tr.optim_step()
    tr.save(tmp_path / "ck")
    again = _trainer(d)
    again.load(tmp_path / "ck")
    _close(again.named_weights(), tr.named_weights(), "resumed weight", rtol=0, atol=0)
    assert again.version == 1
    served = _trainer(str(tmp_path / "ck"))
    assert served.vision is not None
    assert served.logprobs(b) == tr.logprobs(b)


def test_a_critic_and_images_for_a_text_model_are_refused(vlm, tiny_model_dir):
    d, vision = vlm
    with pytest.raises(ValueError, match="algorithm.advantage=gae"):
        _trainer(d, advantage="gae")
    b = _batch(vision, counts=[1])
    text = Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(), pad_token_id=0)
    with pytest.raises(ValueError, match="text-only"):
        text.logprobs(b)


# -- build_batch ---------------------------------------------------------------------------
def _episode(eid: str, gid: str, tokens, mask, blobs, reward: float, segments=(0,)) -> Episode:
    return Episode(eid, gid, "t", "env", tokens=tokens, loss_mask=mask,
                   logprobs=[-1.0 if x else 0.0 for x in mask], versions=[0 if x else -1 for x in mask],
                   reward=reward, segments=list(segments), images=[b.id for b in blobs],
                   image_blobs={b.id: b for b in blobs})


def test_build_batch_gives_each_segment_the_images_whose_runs_start_in_it(vlm):
    """An episode split by a prefix break: its second segment re-renders the first image (its own
    copy) and adds a second; each segment gets the images of its own runs, in order."""
    d, vision = vlm
    a, c, e = picture("red", SIZES[0]), picture("blue", SIZES[1]), picture("green", SIZES[2])
    rng = random.Random(3)
    text = lambda n: [rng.choice(_text_ids(vision)) for _ in range(n)]
    seg0 = text(3) + image_tokens(vision, a) + text(2)
    ans0 = text(4)
    seg1 = text(3) + image_tokens(vision, a) + text(2) + ans0 + text(2) + image_tokens(vision, c) + text(1)
    ans1 = text(3)
    tokens = seg0 + ans0 + seg1 + ans1
    mask = [False] * len(seg0) + [True] * len(ans0) + [False] * len(seg1) + [True] * len(ans1)
    split = _episode("e0", "g0", tokens, mask, [a, a, c], 1.0, segments=(0, len(seg0) + len(ans0)))
    t1, m1 = _sequence(rng, vision, [e], 3)
    single = _episode("e1", "g0", t1, m1, [e], 0.0)
    t2, m2 = _sequence(rng, vision, [], 3)
    plain = _episode("e2", "g1", t2, m2, [], 0.5)
    batch, _ = build_batch([split, single, plain], AlgorithmConfig(), trainer=None, kl_coef=0.0,
                           image_token_id=vision.image_token_id)
    assert batch.tokens == [seg0 + ans0, seg1 + ans1, t1, t2]
    assert [[x.id for x in im] for im in batch.images] == [[a.id], [a.id, c.id], [e.id], []]
    for toks, ims in zip(batch.tokens, batch.images):
        assert len(image_runs(toks, vision.image_token_id)) == len(ims)
    # the trainer takes the batch as it is (positions need each sequence's runs to match its images)
    m = _trainer(d).forward_backward(batch)
    assert all(math.isfinite(v) for v in m.values())
    # an unsplit batch: each episode's own images; no images at all: None
    whole, _ = build_batch([single, plain], AlgorithmConfig(), trainer=None, kl_coef=0.0)
    assert [[x.id for x in im] for im in whole.images] == [[e.id], []]
    assert build_batch([plain], AlgorithmConfig(), trainer=None, kl_coef=0.0)[0].images is None
    # a split episode with images needs the image token to place them
    with pytest.raises(ValueError, match="image_token_id"):
        build_batch([split, single], AlgorithmConfig(), trainer=None, kl_coef=0.0)


# -- two FSDP ranks, one of them without any image -----------------------------------------
WORLD = 2
BUDGET = 70
# rank 0 trains every sequence with images, rank 1 only text sequences (so it runs the vision tower
# on the dummy image alone), with different micro-batch counts (rank 1 joins with dummy passes).
CASES = {"K": {"loss_agg": "token-mean", "kl_coef": 0.1},
         "P": {"loss_agg": "seq-mean-token-sum", "packing": True},
         "L": {"loss_agg": "token-mean", "kl_coef": 0.1, "lora": 4}}
# 2 ranks vs 1 process: the same sums in another order (as tests/test_fsdp.py's TOL); measured:
# gradients ≤ 1.9e-9 (|g| ≤ 0.38), log-probs identical, metrics ≤ 3.7e-8 relative. A rank that skipped
# the vision tower (no dummy image) does not get this far: gloo aborts on the mismatched collective.
TOL = {"rtol": 1e-5, "atol": 1e-6}
FSDP_COUNTS = [0, 1, 2, 1, 0, 0, 2, 1, 0]


def _shards(b: TrainBatch) -> list[list[int]]:
    return [[i for i, im in enumerate(b.images) if im], [i for i, im in enumerate(b.images) if not im]]


def _case_trainer(d, case) -> Trainer:
    kw = dict(CASES[case])
    return _trainer(d, BUDGET, packing=kw.pop("packing", False), lora=kw.pop("lora", 0), **kw)


def _fsdp_worker(rank, port, tmp, d):
    from tidal.models.vision import Vision
    from tidal.trainer.distributed import destroy, init_distributed

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"  # ranks on loopback
    init_distributed(rank, WORLD, "127.0.0.1", port, timeout_s=60)
    try:
        batch = _batch(Vision.load(d), FSDP_COUNTS)
        shard = batch.select(_shards(batch)[rank])
        out = {"shard": _shards(batch)[rank]}
        for case in CASES:
            tr = _case_trainer(d, case)
            out[case, "logprobs"] = tr.logprobs(shard)
            if tr.has_ref:
                out[case, "ref_logprobs"] = tr.ref_logprobs(shard)
            out[case, "metrics"] = tr.forward_backward(shard, totals=batch.totals())
            out[case, "grads"] = _grads(tr.model)
            out[case, "step"] = tr.optim_step()
            if case == "K":  # a checkpoint written by 2 ranks, for one process to resume
                out[case, "weights"] = tr.named_weights()
                tr.save(tmp / "ck2")
        torch.save(out, tmp / f"rank{rank}.pt")
    finally:
        destroy()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_fsdp_ranks_one_without_images_match_one_process(vlm, tmp_path):
    d, vision = vlm
    batch = _batch(vision, FSDP_COUNTS)
    shards = _shards(batch)
    assert shards[0] and shards[1] and not any(batch.images[i] for i in shards[1])
    counts = [len(micro_batches([len(batch.tokens[i]) for i in s], BUDGET)) for s in shards]
    assert counts[0] != counts[1], counts
    ref = {}
    for case in CASES:
        tr = _case_trainer(d, case)
        ref[case, "logprobs"] = tr.logprobs(batch)
        if tr.has_ref:
            ref[case, "ref_logprobs"] = tr.ref_logprobs(batch)
        ref[case, "metrics"] = tr.forward_backward(batch)
        ref[case, "grads"] = _grads(tr.model)
        ref[case, "step"] = tr.optim_step()
    t0 = time.perf_counter()
    mp.spawn(_fsdp_worker, args=(_free_port(), tmp_path, d), nprocs=WORLD, join=True)
    print(f"2 ranks: {time.perf_counter() - t0:.1f} s")
    got, other = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    for case in CASES:
        _close(got[case, "grads"], ref[case, "grads"], f"{case} gradient", **TOL)
        if case != "L":  # LoRA: only adapters train; B starts at 0, so A's gradient is 0
            assert _vision_grad(ref[case, "grads"]) > 0
        for k, v in ref[case, "metrics"].items():
            assert got[case, "metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (case, k)
        assert got[case, "step"]["grad_norm"] == pytest.approx(ref[case, "step"]["grad_norm"], rel=1e-5)
        for key in ("logprobs", "ref_logprobs"):  # each rank scored its own shard
            if (case, key) in ref:
                for out in (got, other):
                    for row, i in zip(out[case, key], out["shard"]):
                        torch.testing.assert_close(torch.tensor(row), torch.tensor(ref[case, key][i]), **TOL)
        # every rank ends the step with the same (global) gradient norm
        assert other[case, "step"]["grad_norm"] == got[case, "step"]["grad_norm"]
    one = _case_trainer(d, "K")
    one.load(tmp_path / "ck2")
    _close(one.named_weights(), got["K", "weights"], "resumed from 2 ranks", rtol=0, atol=0)
