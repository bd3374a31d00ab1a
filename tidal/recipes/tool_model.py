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
import re
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
from tidal.recipes.tiny import SPECIAL_TOKENS, build_model, save_model, train_chatml_tokenizer
from tidal.recipes.tool_worlds import VALUE_WORDS, World, WorldEnv, make_worlds
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


# The generalist tool model's template: CHAT_TEMPLATE with each tool on one line as a signature,
# `name(arg: type, opt?: type, pick: "a" | "b"): description` (as OpenAI's harmony format renders
# tools as TypeScript rather than JSON): a third of the tokens of the JSON schema, so the warm
# start sees three times the episodes in the same build time, and the names the policy copies
# into its calls stand out from the boilerplate.
TOOL_LINES = (
    "{% for t in tools %}{% set f = t['function'] if t.get('function') else t %}"
    "{% set params = f.get('parameters') or {} %}{% set required = params.get('required') or [] %}"
    "- {{ f['name'] }}("
    "{% for k, p in (params.get('properties') or {}).items() %}{% if not loop.first %}, {% endif %}"
    "{{ k }}{% if k not in required %}?{% endif %}: "
    "{% if p.get('enum') %}{{ p['enum'] | map('tojson') | join(' | ') }}"
    "{% elif p.get('type') is string %}{{ p['type'] }}{% elif p.get('type') %}{{ p['type'] | join(' | ') }}"
    "{% else %}any{% endif %}"
    "{% endfor %}): {{ f.get('description') or '' }}{{ '\\n' }}{% endfor %}"
)
COMPACT_TEMPLATE = CHAT_TEMPLATE.replace(
    "# Tools\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>. Tools:\n"
    "{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}", "# Tools\n" + TOOL_LINES)
assert COMPACT_TEMPLATE != CHAT_TEMPLATE


TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_tokenizer(corpus: list[str], vocab_size: int = 768, extra_special: tuple[str, ...] = (),
                    chat_template: str = CHAT_TEMPLATE):
    """Byte-level BPE trained on `corpus`, saved so that it loads back as what it was built as.

    transformers loads the tokenizer of any `qwen2` model as its `Qwen2Tokenizer`, which keeps
    the vocabulary and merges but sets its own normalizer and pre-tokenizer (Qwen's split:
    digits one by one, words, punctuation runs). So the BPE is trained with exactly those,
    taken from a `Qwen2Tokenizer` instance: built and loaded tokenizers then give the same
    tokens. The tool tags are added tokens that are not special (as in Qwen2.5): one token
    each, and kept when the rollout decodes with `skip_special_tokens=True`. `extra_special`:
    more special tokens (a vision model's placeholders)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    qwen = Qwen2Tokenizer()._tokenizer
    tok = Tokenizer(models.BPE())
    tok.normalizer = qwen.normalizer
    tok.pre_tokenizer = qwen.pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([*SPECIAL_TOKENS, *extra_special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    return train_chatml_tokenizer(tok, corpus, vocab_size, chat_template, extra_special)


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


def world_guess(world: World, rng: random.Random) -> str:
    """A hasty answer without the tool: of the right kind, right only by chance."""
    true = world.answer
    if re.fullmatch(r"-?\d+", true):
        return str(int(guessed_answer(int(true), rng)))
    if re.fullmatch(r"-?\d+\.\d+", true):
        return f"{rng.randint(1, 99999) / 100:.2f}".rstrip("0").rstrip(".")
    return rng.choice([w for w in VALUE_WORDS if w != true] + ["none"])


def world_slip(world: World, rng: random.Random) -> str:
    """A slipped call of the world's tool: broken JSON, a wrong tool or argument name, unclosed."""
    spec, args = world.tools[world.target], world.args
    kind = rng.randrange(4)
    if kind == 0:
        return call_text(spec.name, args)[: -len("}</tool_call>")] + "</tool_call>"
    if kind == 1:
        return call_text(spec.verb if spec.name != spec.verb else f"{spec.name}_tool", args)
    if kind == 2:
        first = next(iter(args))
        return call_text(spec.name, {("arg" if first != "arg" else "x"): args[first], **{k: v for k, v in args.items()
                                                                                        if k != first}})
    return call_text(spec.name, args).removesuffix("</tool_call>")


def world_turns(world: World, habit: str, rng: random.Random) -> list[str]:
    """The scripted policy turns of one generated world's demonstration (`teacher_turns`' habits;
    a slipped call is retried right half of the time)."""
    spec = world.tools[world.target]
    call, answer = call_text(spec.name, world.args), f"<answer>{world.answer}</answer>"
    guess = f"<answer>{world_guess(world, rng)}</answer>"
    if habit == "tool":
        return [call, answer]
    if habit == "malformed":
        return [world_slip(world, rng), call, answer] if rng.random() < 0.5 else [world_slip(world, rng), guess]
    return [guess]


def render_only_tokenizer(chat_template: str = COMPACT_TEMPLATE):
    """A tokenizer object with `chat_template` and no vocabulary: renders text, never tokens."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    render = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    render.chat_template = chat_template
    return render


async def episode_segments(render, env, turns: list[str]) -> list[tuple[str, bool]]:
    """A scripted episode of `env` as (text, trained) segments, cut where the rollout tokenizes:
    the prompt once, each policy turn as its own tokens, then only the text the template adds.
    The observations are the env's own."""
    history = await env.reset()
    rendered = render.apply_chat_template(history, tools=env.tools, add_generation_prompt=True, tokenize=False)
    segments = [(rendered, False)]
    for i, text in enumerate(turns):
        segments.append((text + "<|im_end|>", True))
        out = await env.step(Action(text, turn=i))
        if out.done:
            break
        history = [*history, out.assistant_message or {"role": "assistant", "content": text}]
        rendered += text + "<|im_end|>"
        after = render.apply_chat_template(history + out.messages, tools=env.tools, add_generation_prompt=True,
                                           tokenize=False)
        if not after.startswith(rendered):
            raise AssertionError(f"the chat template does not render the teacher's turn as written: {text!r}")
        segments.append((after[len(rendered):], False))
        history, rendered = history + out.messages, after
    await env.close()
    return segments


def scripted_segments(items: list[tuple[Any, list[str]]]) -> list[list[tuple[str, bool]]]:
    """`episode_segments` of (env, turns) pairs."""
    render = render_only_tokenizer()

    async def all_of() -> list:
        return [await episode_segments(render, env, turns) for env, turns in items]

    return asyncio.run(all_of())


def tokenize_segments(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []
    for text, trained in segments:
        new = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += new
        mask += [trained] * len(new)
    return ids, mask


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


def both_success(model, tokenizer, val: dict[str, list], k: int = 4) -> dict:
    """`held_out_success` on the `tool_arith` rows and on held-out generated worlds (tools never
    trained on), flattened as `arith/...` and `worlds/...`."""
    out = {}
    for key, env in (("arith", ToolArithEnv), ("worlds", WorldEnv)):
        res = held_out_success(model, tokenizer, val[key], k=k, env=env)
        out.update({f"{key}/{m}": res.get(m) for m in ("accuracy", "pass_at_k", "failed", "tool_calls",
                                                        "tool_error_rate")})
    return out


def shared_prefix(examples) -> int:
    """Length of the token prefix every example shares (the system turn with the tools)."""
    tokens = [t for t, _ in examples]
    return common_prefix(tokens, min(map(len, tokens)))


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


def sft_loss(model, examples, prefix_len: int, pad_id: int, micro: int = 8) -> torch.Tensor:
    """Token-mean cross-entropy of `examples` (token ids, loss mask), whose first `prefix_len`
    tokens are the same and carry no loss: the prefix goes through the model once and its keys
    and values are shared by the batch (the same loss and gradients as whole sequences, at a
    fraction of the cost: the tools' system turn is most of each sequence)."""
    from transformers import DynamicCache

    if prefix_len == 0:  # nothing shared: whole sequences, sorted by length into micro-batches
        ordered = sorted(examples, key=lambda e: len(e[0]))  # that pad little (the same loss)
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
    steps: int = 1200,
    batch_size: int = 32,
    lr: float = 3e-3,
    warmup: int = 50,
    habits: dict[str, float] | None = None,
    world_frac: float = 0.7,
    eval_every: int = 400,
    eval_n: int = 100,
    train_size: int = 12000,
    vocab_size: int = 1024,
    evaluate=None,
) -> dict:
    """Build tokenizer and model, warm-start them on generated tool worlds and on `tool_arith`,
    save an HF directory; return a summary (also written to `tidal_build.json`).

    `world_frac` of the demonstrations are generated worlds (tidal/recipes/tool_worlds.py:
    random tools, several per prompt, results of every kind), the rest `tool_arith` problems.
    The teacher has three habits, drawn per demonstration (`habits`, fractions): `tool`, the
    right call then the answer read from the tool's result; `direct`, a hasty guess (for
    `tool_arith` the expression restated and the leading digits right, `guessed_answer`);
    `malformed`, a slipped call (broken JSON, wrong tool or argument name, never closed), the
    env's error observation, then a guess (or, in a world, half the time the right call).
    Greedy decoding follows the most common first move, so held-out success starts low while
    right answers are among the samples; which habit pays is what RL has to teach. Validation
    uses a slice of the `tool_arith` *train* split and held-out worlds, whose target tools are
    never trained on.
    """
    habits = habits or {"tool": 0.4, "direct": 0.5, "malformed": 0.1}
    if abs(sum(habits.values()) - 1.0) > 1e-9 or set(habits) - {"tool", "direct", "malformed"}:
        raise ValueError(f"habits must be fractions of tool, direct, malformed summing to 1, got {habits}")
    if not 0 <= world_frac <= 1:
        raise ValueError(f"world_frac must be in [0, 1], got {world_frac}")
    random.seed(seed)
    torch.manual_seed(seed)
    n_worlds = round(train_size * world_frac)
    rows = make_rows("train", train_size - n_worlds + eval_n, seed=20_000 + seed)
    val = {"arith": rows[:eval_n], "worlds": [w.row() for w in make_worlds("test", eval_n, seed)]}
    rng = random.Random(seed)
    names, weights = list(habits), list(habits.values())
    items = [(ToolArithEnv(r, seed=0), teacher_turns(r, rng.choices(names, weights)[0], rng)) for r in rows[eval_n:]]
    items += [(WorldEnv(w.row(), seed=0), world_turns(w, rng.choices(names, weights)[0], rng))
              for w in make_worlds("train", n_worlds, seed)]
    rng.shuffle(items)
    t0 = time.time()
    segments = scripted_segments(items)
    corpus = [text for episode in segments[:3000] for text, _ in episode]
    tokenizer = build_tokenizer(corpus, vocab_size, chat_template=COMPACT_TEMPLATE)
    examples = [tokenize_segments(tokenizer, episode) for episode in segments]
    record_s = time.time() - t0
    model = build_model(tokenizer, seed=seed)
    # a system turn with three tools and a few turns run to ~400 tokens (RoPE: no table to grow)
    model.config.max_position_embeddings = 1024
    evaluate = evaluate or both_success
    history = sft_train(model, tokenizer, examples, 0, val, evaluate, rng, steps=steps, batch_size=batch_size,
                        lr=lr, warmup=warmup, eval_every=eval_every, label="tool", log_every=50)
    save_model(model, tokenizer, out_dir)
    summary = {"seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "habits": habits,
               "world_frac": world_frac, "train_size": train_size, "vocab_size": len(tokenizer),
               "record_s": round(record_s, 1), "threads": torch.get_num_threads(),
               "tokens_per_example": round(sum(len(t) for t, _ in examples) / len(examples), 1),
               "val": history[-1] if history else {}, "params": sum(p.numel() for p in model.parameters()),
               "history": history}
    (Path(out_dir) / "tidal_build.json").write_text(json.dumps(summary, indent=1))
    return summary


def sft_train(model, tokenizer, examples, prefix_len: int, val, evaluate, rng: random.Random, *, steps: int,
              batch_size: int, lr: float, warmup: int, eval_every: int, label: str,
              log_every: int = 0) -> list[dict]:
    """The warm start's SFT loop (AdamW, linear warm-up then cosine, batches drawn with `rng`):
    `evaluate(model, tokenizer, val)` every `eval_every` steps (0: never) and at the end; the
    history of those evaluations. Shared by the tiny models built from demonstrations."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))
    )
    model.train()
    t0 = time.time()
    history = []
    for step in range(1, steps + 1):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        loss = sft_loss(model, batch, prefix_len, tokenizer.pad_token_id)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log_every and step % log_every == 0:
            print(f"{label} warm-start step {step}: loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
        if (eval_every and step % eval_every == 0) or step == steps:
            t1 = time.time()
            res = evaluate(model, tokenizer, val)
            history.append({"step": step, "loss": round(loss.item(), 4), "train_s": round(t1 - t0, 1), **res})
            print(f"{label} warm-start step {step}: loss {loss.item():.3f}  {json.dumps(res)}  ({t1 - t0:.0f}s)",
                  flush=True)
            t0 += time.time() - t1  # train_s counts training only
    return history


