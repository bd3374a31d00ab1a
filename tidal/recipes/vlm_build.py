"""Build the embedded tiny vision-language model: the tiny Qwen2-VL of tidal/recipes/tiny_vlm.py with
a tokenizer trained on the image tasks' texts, warm-started on all three image tasks
(tidal/envs/image_tasks.py) with imperfect habits, so that greedy decoding is mostly wrong while
the right answer is among its samples, and the gain is left to RL.

`tidal build-default-vlm` rebuilds `tidal/models/assets/tiny-vlm` deterministically (same seed,
machine type and thread count → same weights), as tidal/recipes/tiny.py does for the text model.

The teacher has two habits per task, drawn per demonstration (`careful` is the careful one's
share, 0.3 by default). Both read the same thing in the picture; the hasty one then slips:
for `vlm_color` it names the big square's colour (right) or mixes it up with the neighbouring
hue (red/orange, yellow/green, blue/purple); for `vlm_count` it counts the red squares (right)
or counts one too many; for `vlm_zoom` it calls `zoom` on the quarter asked about and names the
colour it sees there (right), or answers at once with the colour of the square diagonally
opposite, a glance at the wrong place in the overview. Greedy decoding follows the hasty habit,
the samples hold the careful one: the reward has to teach which pays.

Why the habits read the same thing: the vision tower learns from scratch here, and it learns
slowly from answers that are a mix of two readings of a picture. Measured while building this
(2 cores, batches of 32, lr 1e-3): a 30/70 mix of the big and the small square's colour left it
blind (pass@1 at chance) after 1500 steps, 500 of them on colours; deterministic instructions
naming either square ("Name the color of the small square.") still left the colour loss near
chance after 300 colour steps; answers that are one reading (the big square's colour) teach it
in ~150. So the warm start runs in two phases: the careful teacher alone for `see_steps` (the
vision tower learns to see), then the mix of both habits (greedy decoding learns the hasty
slip, which needs nothing new to be seen). The zoom task takes two steps of every four: it has
two skills to learn (copy the quarter into the call, read the zoomed picture); with one step
of three its calls named the right quarter at chance.

Demonstrations are episodes of the real rollout (tidal/runtime/rollout.py) driven by a scripted
engine that plays the teacher, so their tokens, masks and images are exactly what RL will see
(placeholders expanded once, the zoom tool's picture as the env returns it). The warm start is a
teacher-forced SFT loop on the Hugging Face model written here: pixel values and grids from the
model's `Vision`, mRoPE positions from `Vision.positions`, the vision special tokens masked as the
policy masks them, loss on the policy's tokens only; the vision tower trains with the rest. One
task per step (the zoom episodes are several times longer, with the tools' system turn, which
goes through the model once per batch: `sft_loss`). Validation uses a slice of each task's
*train* split: held-out stays unseen.

Evaluation goes through `tidal.runtime.evaluate` with the built-in torch engine: the rollout, the
env, the reward and the engine of `tidal eval`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tidal.config import RewardConfig, RewardSpec
from tidal.engines.scripted import ScriptedEngine
from tidal.engines.torch_engine import TorchEngine
from tidal.envs.image_tasks import REGIONS, ColorEnv, CountEnv, ZoomEnv
from tidal.models import DEFAULT_VLM_DIR, stop_token_ids
from tidal.models.vision import Vision, VisionSpec, image_processor, mask_banned
from tidal.recipes.tiny_vlm import CHAT_TEMPLATE, PROCESSOR, build_vlm, build_vlm_tokenizer, save_vlm
from tidal.recipes.tool_model import call_text
from tidal.rewards.pool import build_scorer
from tidal.runtime.evaluate import evaluate_engine
from tidal.runtime.rollout import EpisodeSpec, Rollout
from tidal.types import GenerationRequest, SamplingParams

TASKS = {"vlm_color": ColorEnv, "vlm_count": CountEnv, "vlm_zoom": ZoomEnv}
MAX_TURNS = {"vlm_color": 1, "vlm_count": 1, "vlm_zoom": 3}  # zoom: call, answer, and room for a retry
MAX_NEW_TOKENS = 32  # one turn: an answer or a zoom call
REWARD = "tidal.rewards.vision:score"


# --------------------------------------------------------------------------------------------
# the teacher


# The hasty habit's colour mix-ups: neighbouring hues.
NEIGHBOUR_HUE = {"red": "orange", "orange": "red", "yellow": "green", "green": "yellow", "blue": "purple",
                 "purple": "blue"}


def opposite(region: str) -> str:
    """The quarter diagonally opposite."""
    return REGIONS[len(REGIONS) - 1 - REGIONS.index(region)]


def teacher_turns(task: str, row: dict[str, Any], careful: bool) -> list[str]:
    """The scripted policy turns of one demonstration (module docstring: the two habits)."""
    if task == "vlm_color":
        return [f"<answer>{row['big_color'] if careful else NEIGHBOUR_HUE[row['big_color']]}</answer>"]
    if task == "vlm_count":
        return [f"<answer>{int(row['answer']) + (0 if careful else 1)}</answer>"]
    if task == "vlm_zoom":
        if careful:
            return [call_text("zoom", {"region": row["region"]}), f"<answer>{row['answer']}</answer>"]
        return [f"<answer>{row['colors'][opposite(row['region'])]}</answer>"]
    raise ValueError(f"unknown image task {task!r} (tasks: {', '.join(TASKS)})")


def task_corpus(rows_by_task: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Texts the tokenizer is trained on: each task's rendered prompts (tools included) and every
    habit's turns, with the tool's answer as the template renders it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast


    # a throwaway tokenizer object only to render the template (no vocabulary needed)
    render = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    render.chat_template = CHAT_TEMPLATE
    texts = []
    for task, rows in rows_by_task.items():
        for i, row in enumerate(rows):
            env = TASKS[task](row, seed=0)
            tools = getattr(env, "tools", None) or None
            texts.append(render.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True,
                                                    tokenize=False))
            for careful in (True, False):
                texts += [t + "<|im_end|>\n" for t in teacher_turns(task, row, careful)]
            if tools:
                texts.append("<|im_start|>user\n<tool_response><|vision_start|><|image_pad|><|vision_end|>"
                             "</tool_response><|im_end|>\n")
    return texts


def demonstrations(tokenizer, vision: Vision, task: str, rows: list[dict[str, Any]], careful: list[bool]):
    """Episodes of the rollout with the teacher as the policy (a scripted engine): one per row,
    its habit `careful[i]`. Each is (tokens, loss mask, images)."""
    scripts = {f"demo-{i}": teacher_turns(task, row, c) for i, (row, c) in enumerate(zip(rows, careful))}

    def policy(req: GenerationRequest) -> list[int]:
        turn = int(req.request_id.rsplit("/", 1)[1])
        return tokenizer(scripts[req.session_id][turn] + "<|im_end|>", add_special_tokens=False)["input_ids"]

    rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tokenizer)),
                      max_turns=MAX_TURNS[task], vision=vision)
    specs = [EpisodeSpec(TASKS[task](row, seed=0), f"demo-{i}", f"demo-{i}", row["task_id"], 0, row=row)
             for i, row in enumerate(rows)]
    episodes = asyncio.run(rollout.run(specs, ScriptedEngine(policy, tokenizer=tokenizer), step=0))
    bad = [e for e in episodes if e.status.value != "ok"]
    if bad:
        raise RuntimeError(f"{task}: {len(bad)} teacher demonstrations did not end ok, e.g. {bad[0].error!r}")
    return [(e.tokens, e.loss_mask, e.image_list()) for e in episodes]


# --------------------------------------------------------------------------------------------
# evaluation and the warm start


def held_out(model, tokenizer, vision: Vision, task: str, rows: list[dict[str, Any]], k: int = 8) -> dict[str, Any]:
    """Greedy accuracy and pass@k of `task` on `rows` through `tidal.runtime.evaluate` (the rollout,
    env and reward of `tidal eval`)."""
    model.eval()
    engine = TorchEngine(model, tokenizer.pad_token_id, tokenizer=tokenizer, vision=vision)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=stop_token_ids(tokenizer))
    scorer = build_scorer([RewardSpec(fn=REWARD)], RewardConfig(isolation="inline"))
    try:
        rollout = Rollout(tokenizer, params, max_turns=MAX_TURNS[task], scorer=scorer, vision=vision)
        res = evaluate_engine(engine, rollout, rows, TASKS[task], k=k)
    finally:
        asyncio.run(scorer.close())
        engine.close()
    model.train()
    keep = ("accuracy", "pass_at_k", "pass_at_1", "k", "failed", "tool_calls", "tool_error_rate")
    return {key: round(v, 4) if isinstance(v, float) else v for key, v in res.items() if key in keep}


def vision_of(model) -> Vision:
    """The Vision of a model in memory (its config's token ids, tiny_vlm's image processor)."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
        processor = image_processor(d)
    return Vision(VisionSpec.from_config(model.config.to_dict()), processor)


class _Examples:
    """One task's demonstrations as tensors: tokens, loss masks, mRoPE positions, and each
    image's pixel values (float16 to halve the memory; the model sees them as float32) and grid."""

    def __init__(self, image_token_id: int):
        self.image_token_id = image_token_id
        self.tokens: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.images: list[list[str]] = []
        self.pixels: dict[str, tuple[torch.Tensor, tuple[int, int, int]]] = {}
        self.careful: list[int] = []  # the careful teacher's demonstrations, one per picture
        self.mixed: list[int] = []  # one per picture, of its drawn habit

    def add(self, demos, vision: Vision) -> None:
        """Add demonstrations whose images `vision` processed last (still in its cache: fewer than
        its cache holds, so no picture is processed twice)."""
        for tokens, mask, imgs in demos:
            self.tokens.append(torch.tensor(tokens))
            self.masks.append(torch.tensor(mask))
            self.positions.append(vision.positions(tokens, imgs))
            self.images.append([b.id for b in imgs])
            for b in imgs:
                if b.id not in self.pixels:
                    pv, grid = vision.process(b)
                    self.pixels[b.id] = (pv.to(torch.float16), grid)

    def __len__(self) -> int:
        return len(self.tokens)

    def shared_prefix(self) -> int:
        """Length of the text prefix every demonstration shares, without a loss token or an image."""
        first = self.tokens[0]
        n = min(len(t) for t in self.tokens)
        ends = [int(m.nonzero()[0]) for m in self.masks]  # the first policy token of each
        pads = [int((t == self.image_token_id).nonzero()[0]) if (t == self.image_token_id).any() else n
                for t in self.tokens]
        limit = min(n, *ends, *pads)
        same = torch.stack([t[:limit] == first[:limit] for t in self.tokens]).all(0)
        return int(limit if bool(same.all()) else same.long().argmin())

    def batch(self, idx: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        B, L = len(idx), max(len(self.tokens[i]) for i in idx)
        ids = torch.full((B, L), pad_id)
        labels = torch.full((B, L), -100)
        attn = torch.zeros((B, L), dtype=torch.long)
        pos = torch.zeros((3, B, L), dtype=torch.long)
        for row, i in enumerate(idx):
            n = len(self.tokens[i])
            ids[row, :n] = self.tokens[i]
            attn[row, :n] = 1
            labels[row, :n] = torch.where(self.masks[i], self.tokens[i], -100)
            pos[:, row, :n] = self.positions[i]
        pixels = [self.pixels[b] for i in idx for b in self.images[i]]
        return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "labels": labels,
                "pixel_values": torch.cat([p for p, _ in pixels]).float(),
                "image_grid_thw": torch.tensor([g for _, g in pixels], dtype=torch.long)}


def sft_loss(model, batch: dict[str, torch.Tensor], banned: tuple[int, ...], prefix_len: int = 0) -> torch.Tensor:
    """Token-mean cross-entropy on the policy's tokens under the policy's distribution (the vision
    special tokens masked, as the engines and the trainer mask them).

    `prefix_len` > 0: the batch's first `prefix_len` tokens are the same text (the zoom task's
    system turn with the tools, most of each sequence) and carry no loss; they go through the
    model once and their keys and values are shared by the batch, as tool_model.sft_loss does:
    the same loss and gradients at a fraction of the cost. Text only, so its mRoPE positions are
    0..prefix_len-1 and the rest keep their own."""
    from transformers import DynamicCache

    labels, ids, pos = batch["labels"], batch["input_ids"], batch["position_ids"]
    inputs = {k: batch[k] for k in ("pixel_values", "image_grid_thw")}
    if prefix_len:
        B = ids.shape[0]
        cache = DynamicCache()
        model(input_ids=ids[:1, :prefix_len], position_ids=pos[:, :1, :prefix_len], cache=cache, use_cache=True)
        cache.batch_repeat_interleave(B)
        inputs.update(cache=cache, use_cache=True)
    logits = model(input_ids=ids[:, prefix_len:], attention_mask=batch["attention_mask"],
                   position_ids=pos[:, :, prefix_len:], **inputs).logits
    logits = mask_banned(logits[:, :-1], banned)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels[:, prefix_len + 1 :].reshape(-1), ignore_index=-100)


def _demonstration_sets(tokenizer, vision, train: dict, careful: dict[str, float], rng: random.Random) -> dict:
    """Per task, the careful teacher's demonstrations and the drawn habits' (module docstring), in
    the order the build has always drawn them from `rng`."""
    examples = {}
    for task, task_rows in train.items():
        # per picture: the careful teacher's demonstration (phase 1) and the drawn habit's (phase 2:
        # the same one when the habit is careful)
        habits = [rng.random() < careful[task] for _ in task_rows]
        ex = examples[task] = _Examples(vision.image_token_id)
        for i in range(0, len(task_rows), 100):  # 100 pictures' demonstrations use at most 200 images: all in
            chunk, drawn = task_rows[i : i + 100], habits[i : i + 100]  # vision's cache, none processed twice
            first = len(ex)
            ex.add(demonstrations(tokenizer, vision, task, chunk, [True] * len(chunk)), vision)
            hasty = [r for r, h in zip(chunk, drawn) if not h]
            start = len(ex)
            ex.add(demonstrations(tokenizer, vision, task, hasty, [False] * len(hasty)), vision)
            ex.careful += range(first, start)
            slips = iter(range(start, len(ex)))
            ex.mixed += [first + j if h else next(slips) for j, h in enumerate(drawn)]
    return examples


def _warm_start(model, tokenizer, vision, examples: dict, val: dict, rng: random.Random, *, steps: int,
                see_steps: int, batch_size: int, lr: float, warmup: int, eval_every: int,
                eval_k: int) -> tuple[list[str], dict[str, float]]:
    """The SFT loop: the careful teacher alone for `see_steps`, then the drawn habits; returns the
    task cycle and each task's smoothed loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    banned = vision.banned_token_ids
    model.train()
    # the zoom task takes two steps of every four (module docstring)
    names = ["vlm_color", "vlm_zoom", "vlm_count", "vlm_zoom"]
    # a shared prefix pays for its extra forward only when it is long (the zoom task's tools)
    prefix = {task: p if (p := ex.shared_prefix()) >= 32 else 0 for task, ex in examples.items()}
    losses: dict[str, float] = {}
    t0 = time.time()
    for step in range(1, steps + 1):
        task = names[(step - 1) % len(names)]
        ex = examples[task]
        pool = ex.careful if step <= see_steps else ex.mixed
        loss = sft_loss(model, ex.batch([pool[rng.randrange(len(pool))] for _ in range(batch_size)],
                                        tokenizer.pad_token_id), banned, prefix[task])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses[task] = 0.9 * losses.get(task, loss.item()) + 0.1 * loss.item()
        if eval_every and step % eval_every == 0 and step < steps:
            for t in TASKS:
                print(f"  step {step} {t}: {json.dumps(held_out(model, tokenizer, vision, t, val[t], k=eval_k))}",
                      flush=True)
        if step % 150 == 0 or step == steps:
            print(f"vlm warm-start step {step}: loss " + "  ".join(f"{t} {v:.3f}" for t, v in losses.items())
                  + f"  ({time.time() - t0:.0f}s)", flush=True)
    return names, losses


def build_default_vlm(
    out_dir: str | Path = DEFAULT_VLM_DIR,
    seed: int = 0,
    steps: int = 1200,
    see_steps: int = 480,
    batch_size: int = 32,
    lr: float = 1e-3,
    warmup: int = 50,
    careful: dict[str, float] | None = None,
    train_size: dict[str, int] | None = None,
    eval_n: int = 100,
    eval_k: int = 8,
    vocab_size: int = 768,
    eval_every: int = 0,
) -> dict[str, Any]:
    """Build tokenizer and model, warm-start them on the image tasks, save an HF directory with
    `tidal_build.json` (the recipe and the validation accuracies); return that summary.

    `careful`: the careful habit's share per task (module docstring); `train_size`: distinct
    pictures per task (the `eval_n` before them are the validation slice, never trained on);
    `see_steps`: the first phase, the careful teacher alone. Steps cycle through the tasks, one
    task's batch per step."""
    t_start = time.time()
    careful = careful or {task: 0.3 for task in TASKS}
    train_size = train_size or {"vlm_color": 2000, "vlm_count": 2000, "vlm_zoom": 1200}
    if set(careful) != set(TASKS) or set(train_size) != set(TASKS):
        raise ValueError(f"careful and train_size must name each task ({', '.join(TASKS)})")
    random.seed(seed)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    rows = {task: TASKS[task].rows("train", train_size[task] + eval_n, seed=30_000 + seed) for task in TASKS}
    val = {task: r[:eval_n] for task, r in rows.items()}
    train = {task: r[eval_n:] for task, r in rows.items()}
    tokenizer = build_vlm_tokenizer(task_corpus({task: r[:500] for task, r in train.items()}), vocab_size)
    model = build_vlm(tokenizer, seed=seed)
    vision = vision_of(model)
    examples = _demonstration_sets(tokenizer, vision, train, careful, rng)
    t_data = time.time() - t_start
    print(f"vlm warm-start: {sum(len(e) for e in examples.values())} demonstrations ({t_data:.0f}s)", flush=True)

    t0 = time.time()
    names, losses = _warm_start(model, tokenizer, vision, examples, val, rng, steps=steps, see_steps=see_steps,
                                batch_size=batch_size, lr=lr, warmup=warmup, eval_every=eval_every, eval_k=eval_k)
    train_s = time.time() - t0
    t1 = time.time()
    results = {task: held_out(model, tokenizer, vision, task, val[task], k=eval_k) for task in TASKS}
    for task, res in results.items():
        print(f"vlm warm-start {task}: {json.dumps(res)}", flush=True)
    eval_s = time.time() - t1
    save_vlm(model, tokenizer, out_dir)
    summary = {
        "seed": seed, "steps": steps, "see_steps": see_steps, "batch_size": batch_size, "lr": lr, "warmup": warmup, "careful": careful,
        "train_size": train_size, "task_cycle": names, "vocab_size": len(tokenizer),
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "val": results, "val_note": f"the first {eval_n} rows of each task's train split (seed {30_000 + seed}), "
                                    f"never trained on; pass@{eval_k} at temperature 1",
        "loss": {t: round(v, 4) for t, v in losses.items()},
        "timing_s": {"data": round(t_data, 1), "train": round(train_s, 1), "eval": round(eval_s, 1),
                     "total": round(time.time() - t_start, 1)},
    }
    (Path(out_dir) / "tidal_build.json").write_text(json.dumps(summary, indent=1))
    return summary
