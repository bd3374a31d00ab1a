"""Build the embedded default model: a tiny Qwen2 with a locally trained tokenizer,
warm-started by supervised training on the arithmetic task until it is partly right.

`tidal build-default-model` rebuilds `tidal/models/assets/tiny-arith` deterministically
(same seed and machine type → same weights; thread count changes float summation order).
The demonstrations come from an imperfect teacher (see `build_default_model`), so the
model starts with low greedy accuracy while the right answer is among its samples, and
the warm-start's validation uses a slice of the *train* split: held-out stays unseen.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from pathlib import Path

import torch

from tidal.config import RewardConfig, RewardSpec
from tidal.engines.torch_engine import TorchEngine
from tidal.envs.arithmetic import ArithmeticConfig, answer_text, buggy_answer, make_problems, worked_answer
from tidal.envs.single_turn import ArithmeticEnv
from tidal.models import stop_token_ids
from tidal.rewards.pool import build_scorer
from tidal.runtime.evaluate import evaluate_engine
from tidal.runtime.rollout import Rollout
from tidal.types import SamplingParams

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(corpus: list[str], vocab_size: int = 384):
    """Byte-level BPE (digits always split, as Qwen does) trained on `corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return train_chatml_tokenizer(tok, corpus, vocab_size, CHAT_TEMPLATE)


def train_chatml_tokenizer(tok, corpus, vocab_size: int, chat_template: str, extra_special=(),
                           train_pre_tokenizer=None):
    """Train a byte-level BPE `tok` on `corpus` and wrap it as an HF tokenizer with ChatML's
    special tokens (and `extra_special`) and `chat_template` (the embedded models' shared last steps).
    `train_pre_tokenizer`: split the corpus with it while the merges are learned (and with
    `tok`'s own pre-tokenizer afterwards): a finer split gives merges that never cross its cuts."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    own = tok.pre_tokenizer
    if train_pre_tokenizer is not None:
        tok.pre_tokenizer = train_pre_tokenizer
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.pre_tokenizer = own
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *extra_special],
    )
    fast.chat_template = chat_template
    return fast


def build_model(tokenizer, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=256, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def _operands(row) -> tuple[int, str, int]:
    a, op, b = row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split(" ")
    return int(a), op, int(b)


def task_corpus(rows) -> list[str]:
    """Texts the tokenizer is trained on: rendered prompts and worked answers of the task."""
    corpus = []
    for row in rows:
        corpus.append(f"<|im_start|>user\n{row['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n")
        corpus.append(worked_answer(*_operands(row)) + "<|im_end|>\n")
    return corpus


def save_model(model, tokenizer, out_dir: str | Path) -> Path:
    """The model (safetensors, its cache on for generation) and tokenizer as an HF directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_untrained(out_dir: str | Path, seed: int = 0, **model_kwargs) -> Path:
    """Tokenizer and randomly initialised model, saved as an HF directory (tests use it)."""
    rows = make_problems(ArithmeticConfig(), "train", 2000, seed=10_000 + seed)
    tokenizer = build_tokenizer(task_corpus(rows))
    model = build_model(tokenizer, seed=seed, **model_kwargs)
    return save_model(model, tokenizer, out_dir)


def _sft_example(tokenizer, row, response: str) -> tuple[list[int], list[bool]]:
    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r_ids = tokenizer(response + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return p_ids + r_ids, [False] * len(p_ids) + [True] * len(r_ids)


def held_out_accuracy(model, tokenizer, rows, k: int = 8) -> dict:
    """Greedy accuracy and pass@k on `rows`, through the same evaluation as `tidal eval`, of a copy
    of `model` (an engine takes its model over: a mixture of experts gets the engine's routers)."""
    model = copy.deepcopy(model)
    model.eval()
    engine = TorchEngine(model, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=32, stop_token_ids=stop_token_ids(tokenizer))
    scorer = build_scorer([RewardSpec(fn=ArithmeticEnv.default_reward)], RewardConfig(isolation="inline"))
    try:
        return evaluate_engine(engine, Rollout(tokenizer, params, scorer=scorer), rows, ArithmeticEnv, k=k)
    finally:
        engine.close()


def sft_batch(examples, pad_id: int):
    """(token ids, loss mask) examples as right-padded tensors: ids, attention mask, and labels
    that are -100 wherever the mask is off (the SFT loss's ignore index)."""
    L = max(len(t) for t, _ in examples)
    ids = torch.full((len(examples), L), pad_id)
    labels = torch.full((len(examples), L), -100)
    attn = torch.zeros((len(examples), L), dtype=torch.long)
    for i, (t, m) in enumerate(examples):
        ids[i, : len(t)] = torch.tensor(t)
        attn[i, : len(t)] = 1
        labels[i, : len(t)] = torch.where(torch.tensor(m), torch.tensor(t), -100)
    return ids, attn, labels


def build_default_model(
    out_dir: str | Path,
    seed: int = 0,
    steps: int = 2000,
    batch_size: int = 128,
    lr: float = 3e-3,
    warmup: int = 100,
    careful_fraction: float = 0.3,
    eval_every: int = 250,
    task: ArithmeticConfig | None = None,
    train_size: int = 10_000,
    stop_after: int | None = None,
    model_fn=None,
) -> dict:
    """Build tokenizer and model, warm-start them, save an HF directory; return a summary.

    The demonstrations come from two teachers. A careful one (`careful_fraction` of them)
    works the problem out by place value before answering (`40+30+7+8=70+15=<answer>85`);
    a hasty one answers at once, with the classic student bugs (addition without
    carrying, subtraction that takes the smaller digit from the larger —
    tidal.envs.arithmetic.buggy_answer). The model learns both habits; greedy decoding
    follows the more common, hasty one, so it is right only where the bugs do not bite,
    while careful answers are among its samples. Which habit pays is what the reward
    has to teach: the gain has to come from RL.

    `stop_after` ends the warm start early, on the schedule of `steps` (the learning rate of
    step n is the same as in the full build), evaluating there: a quick check that the build
    still learns what it did, comparable with the shipped model's history at that step.

    `model_fn(tokenizer, seed=)` builds another architecture on the same warm start (default:
    `build_model`; the tiny MoE: tidal/recipes/moe_model.py); the forward's `loss` is what trains
    (an MoE adds its balancing loss there when its config asks for router logits).
    """
    task = task or ArithmeticConfig()
    random.seed(seed)
    torch.manual_seed(seed)
    train = make_problems(task, "train", train_size, seed=10_000 + seed)
    val, train = train[:400], train[400:]
    tokenizer = build_tokenizer(task_corpus(train[:5000]))
    model = (model_fn or build_model)(tokenizer, seed=seed)
    rng = random.Random(seed)
    examples = []
    for row in train:
        a, op, b = _operands(row)
        if rng.random() < careful_fraction:
            response = worked_answer(a, op, b)
        else:
            response = answer_text(buggy_answer(a, op, b))
        examples.append(_sft_example(tokenizer, row, response))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))
    )
    model.train()
    t0 = time.time()
    history = []
    last = min(steps, stop_after or steps)
    for step in range(1, last + 1):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        ids, attn, labels = sft_batch(batch, tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % eval_every == 0 or step == last:
            res = held_out_accuracy(model, tokenizer, val)
            history.append({"step": step, "loss": round(loss.item(), 4), **res})
            print(f"warm-start step {step}: loss {loss.item():.3f}  val accuracy {res['accuracy']:.3f}  "
                  f"pass@8 {res['pass_at_k']:.3f}  ({time.time() - t0:.0f}s)", flush=True)
    out = save_model(model, tokenizer, out_dir)
    summary = {"seed": seed, "steps": steps, "stopped_after": last, "careful_fraction": careful_fraction, "val": history[-1],
               "params": sum(p.numel() for p in model.parameters()), "task": task.model_dump(), "history": history}
    (out / "tidal_build.json").write_text(json.dumps(summary, indent=1))
    return summary
