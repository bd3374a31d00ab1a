"""Build the tiny tool-using model: a tiny Qwen2 with a locally trained tokenizer and a
Qwen2.5-style chat template with tools, warm-started on `tool_arith` with imperfect habits.

`tidal build-tool-model` rebuilds `tidal/models/assets/tiny-tool` deterministically (same seed
and machine type → same weights; thread count changes float summation order), as
tidal/recipes/tiny.py does for the default model.

The tool-call tags are plain text, not special tokens: the rollout decodes the policy's turn
with `skip_special_tokens=True` for the environment, and a special `<tool_call>` would vanish
from what the env parses. The chat template (written here, in the style of Qwen2.5's) renders
`tools=` into the system turn, an assistant turn's `tool_calls` as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` (one per line, after the content), and
consecutive `tool` messages as one user turn of `<tool_response>` blocks. It renders a turn
exactly as the policy writes it, so conversations grow as prefixes of each other.

The demonstrations are made by running the real `ToolArithEnv` on a scripted teacher (so the
observations are the env's own) and come from an imperfect mix of habits (`build_tool_model`).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from tidal.config import RewardConfig, RewardSpec
from tidal.engines.lean_decode import common_prefix
from tidal.engines.torch_engine import TorchEngine
from tidal.envs.base import Action
from tidal.envs.tool_arith import ToolArithEnv, make_rows
from tidal.models import stop_token_ids
from tidal.recipes.tiny import SPECIAL_TOKENS, build_model, save_model, sft_batch, train_chatml_tokenizer
from tidal.rewards.pool import build_scorer
from tidal.runtime.evaluate import evaluate_engine
from tidal.runtime.rollout import Rollout
from tidal.types import SamplingParams

CHAT_TEMPLATE = (
    # No whitespace control: every character below is output. transformers compiles templates
    # with trim_blocks, which drops a newline right after a block tag, hence {{ '\\n' }} there.
    "{% set msgs = messages %}{% set system = none %}"
    "{% if msgs and msgs[0]['role'] == 'system' %}{% set system = msgs[0]['content'] %}{% set msgs = msgs[1:] %}{% endif %}"
    "{% if tools %}"
    "<|im_start|>system\n{% if system %}{{ system }}\n\n{% endif %}"
    "# Tools\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>. Tools:\n"
    "{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}<|im_end|>\n"
    "{% elif system is not none %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
    "{% for m in msgs %}"
    "{% if m['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}"
    "{% if m['content'] %}{{ '\\n' }}{% endif %}"
    "{% for tc in m['tool_calls'] %}"
    "{% set f = tc['function'] if tc.get('function') else tc %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>{\"name\": {{ f['name'] | tojson }}, \"arguments\": "
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or msgs[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user\n{% endif %}"
    "<tool_response>{{ m['content'] }}</tool_response>"
    "{% if loop.last or msgs[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% else %}{{ '\\n' }}{% endif %}"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_tokenizer(corpus: list[str], vocab_size: int = 768, extra_special: tuple[str, ...] = (),
                    chat_template: str = CHAT_TEMPLATE, words_apart: bool = False):
    """Byte-level BPE trained on `corpus`, saved so that it loads back as what it was built as.

    transformers loads the tokenizer of any `qwen2` model as its `Qwen2Tokenizer`, which keeps
    the vocabulary and merges but sets its own normalizer and pre-tokenizer (Qwen's split:
    digits one by one, words, punctuation runs). So the BPE is trained with exactly those,
    taken from a `Qwen2Tokenizer` instance: built and loaded tokenizers then give the same
    tokens. The tool tags are added tokens that are not special (as in Qwen2.5): one token
    each, and kept when the rollout decodes with `skip_special_tokens=True`. `extra_special`:
    more special tokens (a vision model's placeholders).

    `words_apart`: no merge joins ASCII letters to the character before them (a space, a quote,
    an underscore), so a word is the same tokens wherever it stands: `Paris` in a question
    (` Paris`) and in a call (`"Paris"`), `convert` in a tool's signature line and in the call.
    Copying a name or value from the prompt into a call is then what an induction head does
    (attend to the earlier occurrence of the current token, emit the token after it) rather
    than spelling one token sequence as another; it costs about a token per word."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    qwen = Qwen2Tokenizer()._tokenizer
    tok = Tokenizer(models.BPE())
    tok.normalizer = qwen.normalizer
    tok.pre_tokenizer = qwen.pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([*SPECIAL_TOKENS, *extra_special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    apart = None
    if words_apart:  # after the byte-level mapping: a space is `Ġ`, itself a letter, hence ASCII only
        apart = pre_tokenizers.Sequence([qwen.pre_tokenizer, pre_tokenizers.Split(Regex("[A-Za-z]+"), "isolated")])
    return train_chatml_tokenizer(tok, corpus, vocab_size, chat_template, extra_special, apart)


# --------------------------------------------------------------------------------------------
# the teacher


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A well-formed call, exactly as the chat template renders it."""
    return f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}</tool_call>'


def guessed_answer(value: int, rng: random.Random) -> int:
    """A hasty mental estimate: the leading two digits right, the rest guessed (right only
    by chance)."""
    s = str(abs(value))
    if len(s) <= 2:
        return value + rng.choice([-1, 1])
    tail = "".join(str(rng.randrange(10)) for _ in range(len(s) - 2))
    guess = int(s[:2] + tail)
    return -guess if value < 0 else guess


def malformed_call(expr: str, rng: random.Random) -> str:
    """One of the slips seen in real tool use: broken JSON, a wrong tool name, a wrong
    argument name, a call that is never closed."""
    kind = rng.randrange(4)
    if kind == 0:
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}</tool_call>'
    if kind == 1:
        return call_text("calc", {"expression": expr})
    if kind == 2:
        return call_text("calculator", {"expr": expr})
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}'


def teacher_turns(row: dict[str, Any], habit: str, rng: random.Random) -> list[str]:
    """The scripted policy turns of one demonstration; the later turns depend only on the
    habit, the env's observations are the env's own."""
    expr, value = row["expression"], int(row["answer"])
    hasty = f"{expr} = <answer>{guessed_answer(value, rng)}</answer>"  # restates, then guesses
    if habit == "tool":
        return [call_text("calculator", {"expression": expr}), f"<answer>{value}</answer>"]
    if habit == "malformed":
        return [malformed_call(expr, rng), hasty]
    return [hasty]


async def _demonstration(tokenizer, row: dict[str, Any], turns: list[str]) -> tuple[list[int], list[bool]]:
    """Tokens and loss mask of a scripted episode, tokenized as the rollout does: the prompt
    once, each policy turn as its own tokens, then only the text the template adds."""
    env = ToolArithEnv(row, seed=0)
    history = await env.reset()
    rendered = tokenizer.apply_chat_template(history, tools=env.tools, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    mask = [False] * len(ids)
    for i, text in enumerate(turns):
        turn_ids = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids += turn_ids
        mask += [True] * len(turn_ids)
        out = await env.step(Action(text, turn=i))
        if out.done:
            break
        history = [*history, out.assistant_message or {"role": "assistant", "content": text}]
        rendered += text + "<|im_end|>"
        after = tokenizer.apply_chat_template(history + out.messages, tools=env.tools, add_generation_prompt=True,
                                              tokenize=False)
        if not after.startswith(rendered):
            raise AssertionError(f"the chat template does not render the teacher's turn as written: {text!r}")
        new = tokenizer(after[len(rendered):], add_special_tokens=False)["input_ids"]
        ids += new
        mask += [False] * len(new)
        history, rendered = history + out.messages, after
    await env.close()
    return ids, mask


def demonstrations(tokenizer, rows, habits: list[str], rng: random.Random) -> list[tuple[list[int], list[bool]]]:
    async def all_of() -> list:
        return [await _demonstration(tokenizer, r, teacher_turns(r, h, rng)) for r, h in zip(rows, habits)]

    return asyncio.run(all_of())


async def _render_all(rows, rng: random.Random, tokenizer=None) -> list[str]:
    """Texts for the tokenizer: rendered prompts with tools and every habit's turns."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    # a throwaway tokenizer object only to render the template (no vocabulary needed)
    render = tokenizer or PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    render.chat_template = CHAT_TEMPLATE
    texts = []
    for i, row in enumerate(rows):
        env = ToolArithEnv(row, seed=0)
        history = await env.reset()
        texts.append(render.apply_chat_template(history, tools=env.tools, add_generation_prompt=True, tokenize=False))
        habit = ("tool", "direct", "malformed")[i % 3]
        for j, text in enumerate(teacher_turns(row, habit, rng)):
            texts.append(text + "<|im_end|>\n")
            out = await env.step(Action(text, turn=j))
            texts.extend(f"<|im_start|>user\n<tool_response>{m['content']}</tool_response><|im_end|>\n"
                         for m in out.messages)
    return texts


# --------------------------------------------------------------------------------------------
# evaluation and the build


def held_out_success(model, tokenizer, rows, k: int = 4, max_turns: int = 4, max_new_tokens: int = 48,
                     env=ToolArithEnv) -> dict:
    """Greedy success and pass@k on `rows` of `env` (its `default_reward` scores) through the
    same rollout, env and verifier as `tidal eval` (also the tool-call error rate of the greedy
    episodes)."""
    model.eval()
    engine = TorchEngine(model, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tokenizer))
    scorer = build_scorer([RewardSpec(fn=env.default_reward)], RewardConfig(isolation="inline"))
    try:
        res = evaluate_engine(engine, Rollout(tokenizer, params, max_turns=max_turns, scorer=scorer), rows, env, k=k)
    finally:
        asyncio.run(scorer.close())
        engine.close()
    model.train()
    return res


def shared_prefix(examples) -> int:
    """Length of the token prefix every example shares (the system turn with the tools)."""
    tokens = [t for t, _ in examples]
    return common_prefix(tokens, min(map(len, tokens)))


def sft_loss(model, examples, prefix_len: int, pad_id: int, micro: int = 8) -> torch.Tensor:
    """Token-mean cross-entropy of `examples` (token ids, loss mask), whose first `prefix_len`
    tokens are the same and carry no loss: the prefix goes through the model once and its keys
    and values are shared by the batch (the same loss and gradients as whole sequences, at a
    fraction of the cost: the tools' system turn is most of each sequence). `prefix_len` 0:
    whole sequences, sorted by length into micro-batches of `micro` that pad little."""
    from transformers import DynamicCache

    if prefix_len == 0:
        ordered = sorted(examples, key=lambda e: len(e[0]))
        total, n = torch.zeros(()), sum(sum(m[1:]) for _, m in examples)
        for i in range(0, len(ordered), micro):
            ids, attn, labels = sft_batch(ordered[i : i + micro], pad_id)
            logits = model(input_ids=ids, attention_mask=attn).logits
            total = total + torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100,
                reduction="sum")
        return total / max(n, 1)
    B = len(examples)
    prefix = torch.tensor([examples[0][0][:prefix_len]])
    cache = DynamicCache()
    model(input_ids=prefix, cache=cache, use_cache=True)
    cache.batch_repeat_interleave(B)
    ids, attn, labels = sft_batch([(t[prefix_len:], m[prefix_len:]) for t, m in examples], pad_id)
    S = ids.shape[1]
    mask = torch.cat([torch.ones(B, prefix_len, dtype=attn.dtype), attn], 1)
    pos = torch.arange(prefix_len, prefix_len + S).unsqueeze(0).expand(B, S)
    logits = model(input_ids=ids, attention_mask=mask, cache=cache, position_ids=pos, use_cache=True).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


def build_tool_model(
    out_dir: str | Path,
    seed: int = 0,
    steps: int = 1500,
    batch_size: int = 32,
    lr: float = 3e-3,
    warmup: int = 50,
    habits: dict[str, float] | None = None,
    eval_every: int = 500,
    eval_n: int = 100,
    train_size: int = 8000,
    vocab_size: int = 768,
    evaluate=None,
) -> dict:
    """Build tokenizer and model, warm-start them on `tool_arith`, save an HF directory; return
    a summary (also written to `tidal_build.json`).

    The teacher has three habits, drawn per demonstration (`habits`, fractions): `tool`, the
    right call then the answer read from the tool's result; `direct`, the expression restated
    and a hasty guess whose leading digits are right and the rest made up (`guessed_answer`);
    `malformed`, a slipped call (broken JSON, wrong tool or argument name, never closed), the
    env's error observation, then a hasty guess. Greedy decoding follows the most common first
    move (direct), so held-out success starts low while right answers are among the samples;
    which habit pays is what RL has to teach. Validation uses a slice of the *train* split.
    """
    habits = habits or {"tool": 0.3, "direct": 0.6, "malformed": 0.1}
    if abs(sum(habits.values()) - 1.0) > 1e-9 or set(habits) - {"tool", "direct", "malformed"}:
        raise ValueError(f"habits must be fractions of tool, direct, malformed summing to 1, got {habits}")
    random.seed(seed)
    torch.manual_seed(seed)
    rows = make_rows("train", train_size, seed=20_000 + seed)
    val, train = rows[:eval_n], rows[eval_n:]
    rng = random.Random(seed)
    tokenizer = build_tokenizer(asyncio.run(_render_all(train[:2000], random.Random(seed + 1))), vocab_size)
    model = build_model(tokenizer, seed=seed)
    # episodes with the tools' system turn and two turns run to ~200 tokens (RoPE: no table to grow)
    model.config.max_position_embeddings = 512
    names, weights = list(habits), list(habits.values())
    drawn = [rng.choices(names, weights)[0] for _ in train]
    examples = demonstrations(tokenizer, train, drawn, rng)
    prefix_len = shared_prefix(examples)
    evaluate = evaluate or held_out_success
    history = sft_train(model, tokenizer, examples, prefix_len, val, evaluate, rng, steps=steps,
                        batch_size=batch_size, lr=lr, warmup=warmup, eval_every=eval_every, label="tool")
    save_model(model, tokenizer, out_dir)
    summary = {"seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "habits": habits,
               "train_size": train_size, "vocab_size": len(tokenizer), "val": history[-1] if history else {},
               "params": sum(p.numel() for p in model.parameters()), "history": history}
    (Path(out_dir) / "tidal_build.json").write_text(json.dumps(summary, indent=1))
    return summary


def sft_train(model, tokenizer, examples, prefix_len: int, val, evaluate, rng: random.Random, *, steps: int,
              batch_size: int, lr: float, warmup: int, eval_every: int, label: str,
              log_every: int = 0, losses: list | None = None, stop_after: int | None = None) -> list[dict]:
    """The warm start's SFT loop (AdamW, linear warm-up then cosine, batches drawn with `rng`):
    `evaluate(model, tokenizer, val)` every `eval_every` steps (0: never) and at the end; the
    history of those evaluations. Shared by the tiny models built from demonstrations.
    `log_every`: print the loss (and append `[step, loss]` to `losses`) that often;
    `stop_after`: end early, on the schedule of `steps`."""
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
        loss = sft_loss(model, batch, prefix_len, tokenizer.pad_token_id)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log_every and step % log_every == 0:
            if losses is not None:
                losses.append([step, round(loss.item(), 4)])
            print(f"{label} warm-start step {step}: loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
        if (eval_every and step % eval_every == 0) or step == last:
            t1 = time.time()
            res = evaluate(model, tokenizer, val)
            history.append({"step": step, "loss": round(loss.item(), 4), "train_s": round(t1 - t0, 1), **res})
            print(f"{label} warm-start step {step}: loss {loss.item():.3f}  {json.dumps(res)}  ({t1 - t0:.0f}s)",
                  flush=True)
            t0 += time.time() - t1  # train_s counts training only
    return history


