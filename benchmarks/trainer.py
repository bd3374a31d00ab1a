"""Trainer throughput, side by side in one process: tidal's Trainer against a bare PyTorch loop
(the same model, batch, micro-batches and optimizer, written plainly), packed against padded
on a long-tailed batch, each group's prompt once against packing alone, float32 against
bfloat16 mixed precision.

    python benchmarks/trainer.py [--rounds 4] [--steps 4,1] [--models default,mid]
                                 [--out benchmarks/results/trainer.json]

The batch is GRPO-shaped: 32 prompts × 8 samples (the default job's), each prompt an
arithmetic prompt of the default task tokenized as the rollout does, each completion random
tokens of long-tailed length (log-normal, median 24, at most 192: a few long answers among
many short ones, as RL batches are), the loss mask on the completion, advantages ±1 within a
group. One step = the batch's forward and backward in micro-batches of `--micro-batch-tokens`
padded tokens + a clipped AdamW step. Tokens/s counts real tokens (prompt and completion, no
padding) per second of step.

Contenders, each a fresh copy of the same weights:
- `bare`: plain PyTorch: per micro-batch (tidal's split, so both compute the same padded
  tensors) a padded forward with an attention mask, log-softmax and gather, the on-policy PPO
  clip loss under the batch's token-mean, backward; then clip_grad_norm_ and AdamW.
- `tidal`: `Trainer.forward_backward` + `optim_step`, float32, padded (the default).
- `tidal-packed`: `train.packing=true`.
- `tidal-shared`: `train.packing=true train.share_prompts=true` (each group's prompt computed once).
- `tidal-bf16`: `train.mixed_precision=true` (autocast bfloat16 over float32 weights).

All five are built once per model and warmed up with one untimed step each; then each runs
its model's `--steps` timed steps per round, the contenders alternating within a round in an order that
rotates from round to round, because this machine is shared and noisy: compare within a
round, as ratios to `bare`; the summary is the median ratio over rounds.
- `default`: the embedded 1M-parameter model (hidden 128, 4 layers).
- `mid`: a 24M-parameter Qwen2 (hidden 512, 6 layers, random weights, the same tokenizer;
  benchmarks/engines.py builds it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines import build_mid_model  # benchmarks/engines.py, beside this file

from tidal.config import AlgorithmConfig, TrainConfig
from tidal.envs.arithmetic import ArithmeticConfig, make_problems
from tidal.models import DEFAULT_MODEL_DIR, load_model, load_tokenizer
from tidal.trainer.trainer import TrainBatch, Trainer, micro_batches, pad_rows

PROMPTS, SAMPLES = 32, 8
CONTENDERS = ("bare", "tidal", "tidal-packed", "tidal-shared", "tidal-bf16")


def make_batch(model_dir: Path, seed: int = 0) -> TrainBatch:
    tokenizer = load_tokenizer(model_dir)
    rng = random.Random(seed)
    rows = make_problems(ArithmeticConfig(), "train", PROMPTS, seed=seed)
    vocab = len(tokenizer)
    tokens, masks, advs = [], [], []
    for row in rows:
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        for s in range(SAMPLES):
            n = min(192, max(2, int(math.exp(rng.gauss(math.log(24), 0.8)))))
            completion = [rng.randrange(3, vocab) for _ in range(n)]
            tokens.append(prompt + completion)
            masks.append([False] * len(prompt) + [True] * n)
            sign = 1.0 if s % 2 == 0 else -1.0  # half the group above its mean, half below
            advs.append([sign] * (len(prompt) + n - 1))
    return TrainBatch(tokens, masks, advs, [[0.0] * len(t) for t in tokens])


class Bare:
    """The loop a user would write by hand: nothing but the model, the loss and AdamW."""

    def __init__(self, model_dir: Path, train: TrainConfig, algo: AlgorithmConfig):
        self.model = load_model(model_dir)
        self.model.config.use_cache = False
        self.model.train()
        self.train, self.algo = train, algo
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=train.lr, betas=train.betas,
                                     weight_decay=train.weight_decay)

    def step(self, batch: TrainBatch) -> None:
        total = sum(sum(m[1:]) for m in batch.loss_mask)
        for idx in micro_batches([len(t) for t in batch.tokens], self.train.micro_batch_tokens):
            ids = pad_rows([batch.tokens[i] for i in idx], 0, torch.long)
            attn = pad_rows([[1] * len(batch.tokens[i]) for i in idx], 0, torch.long)
            mask = pad_rows([batch.loss_mask[i][1:] for i in idx], False, torch.bool)
            adv = pad_rows([batch.advantages[i] for i in idx], 0.0, torch.float32)
            logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            logp = logits.float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())
            clipped = ratio.clamp(1 - self.algo.clip_low, 1 + self.algo.clip_high)
            loss = (-torch.minimum(ratio * adv, clipped * adv) * mask).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def contender(name: str, model_dir: Path, micro_batch_tokens: int):
    train = TrainConfig(micro_batch_tokens=micro_batch_tokens, warmup_steps=0,
                        packing=name in ("tidal-packed", "tidal-shared"), share_prompts=name == "tidal-shared",
                        mixed_precision=name == "tidal-bf16")
    algo = AlgorithmConfig()
    if name == "bare":
        return Bare(model_dir, train, algo).step
    trainer = Trainer(str(model_dir), train, algo)

    def step(batch: TrainBatch) -> None:
        trainer.forward_backward(batch)
        trainer.optim_step()

    return step


def measure(step, batch: TrainBatch, steps: int) -> float:
    """Real tokens per second over `steps` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        step(batch)
    return steps * sum(len(t) for t in batch.tokens) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", default="4,1", help="timed steps per contender per round, one per model (a 24M step is ~20x a 1M one)")
    p.add_argument("--models", default="default,mid")
    p.add_argument("--micro-batch-tokens", type=int, default=8192, help="train.micro_batch_tokens (tidal's default)")
    p.add_argument("--out", default="benchmarks/results/trainer.json")
    a = p.parse_args()
    torch.manual_seed(0)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = a.models.split(",")
        steps = dict(zip(models, (int(x) for x in a.steps.split(",")), strict=True))
        for model in models:
            model_dir = DEFAULT_MODEL_DIR if model == "default" else build_mid_model(Path(tmp) / "mid")
            batch = make_batch(model_dir)
            lengths = [len(t) for t in batch.tokens]
            real = sum(lengths)
            padded = sum(len(i) * max(lengths[j] for j in i) for i in micro_batches(lengths, a.micro_batch_tokens))
            steppers = {name: contender(name, model_dir, a.micro_batch_tokens) for name in CONTENDERS}
            for step in steppers.values():  # warm-up: allocator, kernels' first calls, AdamW's state
                step(batch)
            rounds = []
            for r in range(a.rounds):
                order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
                tps = {name: measure(steppers[name], batch, steps[model]) for name in order}
                row = {"round": r + 1, "order": list(order), "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
                       "vs_bare": {k: round(v / tps["bare"], 3) for k, v in tps.items() if k != "bare"},
                       "packed_vs_padded": round(tps["tidal-packed"] / tps["tidal"], 3),
                       "shared_vs_packed": round(tps["tidal-shared"] / tps["tidal-packed"], 3),
                       "bf16_vs_fp32": round(tps["tidal-bf16"] / tps["tidal"], 3)}
                rounds.append(row)
                print(model, json.dumps(row), flush=True)
            median = lambda f, rounds=rounds: round(statistics.median(f(x) for x in rounds), 3)
            results[model] = {
                "steps": steps[model], "sequences": len(lengths), "real_tokens": real, "padded_tokens": padded,
                "longest": max(lengths), "median_length": statistics.median(lengths), "rounds": rounds,
                "median": {"tidal_vs_bare": median(lambda x: x["vs_bare"]["tidal"]),
                           "packed_vs_bare": median(lambda x: x["vs_bare"]["tidal-packed"]),
                           "packed_vs_padded": median(lambda x: x["packed_vs_padded"]),
                           "shared_vs_packed": median(lambda x: x["shared_vs_packed"]),
                           "bf16_vs_fp32": median(lambda x: x["bf16_vs_fp32"])}}
    out = {"models": results, "micro_batch_tokens": a.micro_batch_tokens,
           "command": "python benchmarks/trainer.py " + " ".join(sys.argv[1:]),
           "machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "python": platform.python_version(),
                       "torch": torch.__version__}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print("| model | round | bare tok/s | tidal | packed | shared | bf16 | tidal / bare | packed / padded "
          "| shared / packed | bf16 / fp32 |\n" + "| --- " * 11 + "|")
    for model, res in results.items():
        for x in res["rounds"]:
            t = x["tokens_per_s"]
            print(f"| {model} | {x['round']} | {t['bare']:.0f} | {t['tidal']:.0f} | {t['tidal-packed']:.0f} | "
                  f"{t['tidal-shared']:.0f} | {t['tidal-bf16']:.0f} | {x['vs_bare']['tidal']:.2f} | "
                  f"{x['packed_vs_padded']:.2f} | {x['shared_vs_packed']:.2f} | {x['bf16_vs_fp32']:.2f} |")


if __name__ == "__main__":
    main()
