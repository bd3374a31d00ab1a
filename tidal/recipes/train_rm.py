"""`tidal train-rm`: a tiny reward model, trained by Bradley–Terry on synthetic preference
pairs of the arithmetic task, so that tests and examples use a real one.

The model is `Qwen2ForSequenceClassification` (num_labels=1) initialised from the embedded
tiny policy (`tidal/models/assets/tiny-arith`) with a fresh score head, and its tokenizer.
Each pair is one problem of the task's *train* split with a correct answer in the task's
format (`<answer>85</answer>`, or worked: `40+30+7+8=70+15=<answer>85</answer>`) over a wrong
one: the hasty student's buggy answer (`tidal.envs.arithmetic.buggy_answer`), an answer off
by a little, a worked answer whose final number is wrong, or the right number in the wrong
format. Held-out pairs, built the same way from the held-out split, only measure. The loss
is −log σ(r_chosen − r_rejected), averaged over the pairs of a batch.

The text scored is the prompt rendered by the chat template (as the policy saw it)
followed by the completion, with the end-of-turn token half of the time (tidal's rewards see
the completion without it; OpenRLHF's queries include it), the same for both texts of a pair
so that it is no cue. Deterministic from the seed at a fixed thread count.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from tidal.envs.arithmetic import ArithmeticConfig, answer_text, buggy_answer, make_problems, worked_answer
from tidal.models import DEFAULT_MODEL_DIR, load_tokenizer
from tidal.rewards.rm import META_FILE, encode

REJECTED_KINDS = {"buggy": 0.35, "off_by": 0.25, "worked_wrong": 0.25, "format": 0.15}


def operands(row: dict[str, Any]) -> tuple[int, str, int]:
    a, op, b = row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split(" ")
    return int(a), op, int(b)


def _near_miss(value: int, rng: random.Random) -> int:
    return value + rng.choice([-10, -2, -1, 1, 2, 10])


def preference_pair(row: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """One pair for a problem row: chosen and rejected completions and the rejected's kind."""
    a, op, b = operands(row)
    value = int(row["answer"])
    kind = rng.choices(list(REJECTED_KINDS), weights=list(REJECTED_KINDS.values()))[0]
    if kind == "buggy" and buggy_answer(a, op, b) == value:
        kind = "off_by"  # the bugs do not bite on this problem: its buggy answer is right
    if kind == "worked_wrong" and op not in "+-":
        kind = "off_by"
    # Where only the number differs, both answers have the same form: the model must check
    # the number, not prefer a form. Against buggy or badly formatted answers either form wins.
    worked = kind == "worked_wrong" or (kind in ("buggy", "format") and op in "+-" and rng.random() < 0.5)
    chosen = worked_answer(a, op, b) if worked else answer_text(value)
    if kind == "buggy":
        rejected = answer_text(buggy_answer(a, op, b))
    elif kind == "off_by":
        rejected = answer_text(_near_miss(value, rng))
    elif kind == "worked_wrong":
        work = worked_answer(a, op, b).removesuffix(answer_text(value))
        wrong = buggy_answer(a, op, b)
        rejected = work + answer_text(wrong if wrong != value and rng.random() < 0.5 else _near_miss(value, rng))
    else:
        rejected = rng.choice([str(value), f"The answer is {value}.", f"<answer>{value}", ""])
    return {"prompt": row["prompt"], "chosen": chosen, "rejected": rejected, "kind": kind, "answer": row["answer"]}


def make_pairs(split: str, n: int, seed: int, task: ArithmeticConfig | None = None) -> list[dict[str, Any]]:
    """`n` pairs, one per distinct problem of `split` ("train" or "test")."""
    rows = make_problems(task or ArithmeticConfig(), split, n, seed=seed)
    rng = random.Random(f"rm-pairs-{split}-{seed}")
    return [preference_pair(r, rng) for r in rows]


def pair_texts(tokenizer, pairs: list[dict[str, Any]], rng: random.Random | None) -> tuple[list[str], list[str]]:
    """(chosen texts, rejected texts): rendered prompt + completion, with the end-of-turn
    token on both or neither (drawn from `rng`; None: never)."""
    chosen, rejected = [], []
    for p in pairs:
        prompt = tokenizer.apply_chat_template(p["prompt"], add_generation_prompt=True, tokenize=False)
        end = tokenizer.eos_token if rng is not None and rng.random() < 0.5 else ""
        chosen.append(prompt + p["chosen"] + end)
        rejected.append(prompt + p["rejected"] + end)
    return chosen, rejected


@torch.inference_mode()
def score_texts(model, tokenizer, texts: list[str], batch_size: int = 128, max_length: int = 256) -> list[float]:
    out: list[float] = []
    for i in range(0, len(texts), batch_size):
        ids, attn, _ = encode(tokenizer, texts[i : i + batch_size], max_length)
        out += model(input_ids=ids, attention_mask=attn).logits[:, 0].float().tolist()
    return out


def pairwise_accuracy(model, tokenizer, pairs: list[dict[str, Any]], max_length: int = 256) -> dict[str, Any]:
    """Fraction of pairs whose chosen text scores above its rejected one (ties count as
    wrong), overall and per rejected kind, with and without the end-of-turn token; and the
    mean and std of all scores."""
    was_training = model.training
    model.eval()
    res: dict[str, Any] = {"n": len(pairs)}
    all_scores: list[float] = []
    base_c, base_r = pair_texts(tokenizer, pairs, None)
    for key, end in (("accuracy", ""), ("accuracy_eos", tokenizer.eos_token)):
        c, r = [t + end for t in base_c], [t + end for t in base_r]
        sc = score_texts(model, tokenizer, c, max_length=max_length)
        sr = score_texts(model, tokenizer, r, max_length=max_length)
        wins = [x > y for x, y in zip(sc, sr)]
        res[key] = sum(wins) / len(pairs)
        if not end:
            res["by_kind"] = {k: round(sum(w for w, p in zip(wins, pairs) if p["kind"] == k)
                                       / max(1, sum(p["kind"] == k for p in pairs)), 4)
                              for k in REJECTED_KINDS}
        all_scores += sc + sr
    mean = sum(all_scores) / len(all_scores)
    std = math.sqrt(sum((s - mean) ** 2 for s in all_scores) / len(all_scores)) or 1.0
    res["score_stats"] = {"mean": mean, "std": std}
    model.train(was_training)
    return res


def _load_init(init: str | Path, seed: int):
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging


    tokenizer = load_tokenizer(init)
    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialized" is the point, not a warning
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(init), num_labels=1, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.pad_token_id = tokenizer.pad_token_id
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the head's initialisation is ours, from the seed
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) * model.config.initializer_range)
    return model, tokenizer


def train_reward_model(out: str | Path, init: str | Path | None = None, pairs: int = 4000, steps: int = 400,
                       batch_size: int = 32, lr: float = 1e-3, warmup: int = 20, seed: int = 0,
                       heldout_pairs: int = 500, eval_every: int = 100, threads: int | None = None,
                       task: ArithmeticConfig | None = None, log=print) -> dict[str, Any]:
    """Train, measure on held-out pairs, save an HF directory with `tidal_rm.json`; return the summary."""
    if pairs < 1 or steps < 1 or batch_size < 1 or heldout_pairs < 1:
        raise ValueError(f"train-rm: pairs, steps, batch size and held-out pairs must be >= 1 "
                         f"(got {pairs}, {steps}, {batch_size}, {heldout_pairs})")
    if threads:
        torch.set_num_threads(threads)
    init = Path(init or DEFAULT_MODEL_DIR)
    task = task or ArithmeticConfig()
    t0 = time.time()
    torch.manual_seed(seed)
    model, tokenizer = _load_init(init, seed)
    train = make_pairs("train", pairs, seed, task)
    heldout = make_pairs("test", heldout_pairs, seed, task)
    max_length = int(model.config.max_position_embeddings)
    rng = random.Random(f"rm-train-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    model.train()
    history = []
    window: list[tuple[float, float]] = []
    before = pairwise_accuracy(model, tokenizer, heldout, max_length)
    log(f"train-rm: {len(train)} train pairs, {len(heldout)} held-out pairs; held-out pairwise accuracy at init "
        f"{before['accuracy']:.3f}")
    for step in range(1, steps + 1):
        batch = [train[rng.randrange(len(train))] for _ in range(batch_size)]
        chosen, rejected = pair_texts(tokenizer, batch, rng)
        ids, attn, _ = encode(tokenizer, chosen + rejected, max_length)
        r = model(input_ids=ids, attention_mask=attn).logits[:, 0]
        margin = r[:batch_size] - r[batch_size:]
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        window.append((loss.item(), (margin > 0).float().mean().item()))
        if step % eval_every == 0 and step < steps:
            acc = pairwise_accuracy(model, tokenizer, heldout[:200], max_length)  # cheaper; all of them at the end
            rec = {"step": step, "loss": round(sum(w[0] for w in window) / len(window), 4),
                   "train_accuracy": round(sum(w[1] for w in window) / len(window), 4),
                   "heldout200_accuracy": acc["accuracy"],  # the first 200 held-out pairs
                   "elapsed_s": round(time.time() - t0, 1)}
            window = []
            history.append(rec)
            log(f"train-rm step {step}: loss {rec['loss']:.4f}  train acc {rec['train_accuracy']:.3f}  "
                f"held-out pairwise acc {acc['accuracy']:.3f}  ({rec['elapsed_s']:.0f}s)")
    final = pairwise_accuracy(model, tokenizer, heldout, max_length)
    history.append({"step": steps, "loss": round(sum(w[0] for w in window) / max(1, len(window)), 4),
                    "train_accuracy": round(sum(w[1] for w in window) / max(1, len(window)), 4),
                    "heldout_accuracy": final["accuracy"], "elapsed_s": round(time.time() - t0, 1)})
    log(f"train-rm done: held-out pairwise accuracy {final['accuracy']:.3f} ({final['n']} pairs; with the end-of-turn "
        f"token {final['accuracy_eos']:.3f}); by kind {final['by_kind']}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = ["Qwen2ForSequenceClassification"]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    summary = {
        "init": str(init), "seed": seed, "pairs": len(train), "steps": steps, "batch_size": batch_size, "lr": lr,
        "threads": torch.get_num_threads(), "task": task.model_dump(), "rejected_kinds": REJECTED_KINDS,
        "heldout": {k: v for k, v in final.items() if k != "score_stats"}, "heldout_at_init": before["accuracy"],
        "score_stats": final["score_stats"], "history": history, "wall_s": round(time.time() - t0, 1),
        "text": "chat-template prompt (add_generation_prompt) + completion [+ eos]; score = logit at the last token",
    }
    (out / META_FILE).write_text(json.dumps(summary, indent=1))
    return summary
