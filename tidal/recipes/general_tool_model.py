"""Build the embedded general tool model (`model.path: default-tool`,
tidal/models/assets/tiny-tool-general): a tiny model that calls tools it never saw from the
schemas in its prompt, warm-started on generated tool worlds (tidal/recipes/tool_worlds.py:
random tools, several per prompt, results of every kind), copy drills and `tool_arith`.

`tidal build-general-tool-model` rebuilds it from its seed (the same tokenizer, demonstrations
and batches; the weights equal up to float rounding, which MKL makes depend on memory alignment:
two processes on one machine differed by 0.01 in the step-50 loss) in two phases, 3000 SFT
steps (`build_general_tool_model`) then 4500 (`tune_general_tool_model`) on *wide* worlds
(tidal/recipes/world_phrasing.py: more name styles, question frames and result kinds); about 70
CPU minutes. The recipe shares tidal/recipes/tool_model.py's
tokenizer, chat template (but for how tools are rendered), teacher habits and SFT loop.

The choice it makes: copying is what is trained. Names are mostly coined (unrememberable), over
a third of the examples are copy drills (`copy_drill`), every token is trained (the
prompt's too), the tokenizer keeps words apart from what precedes them (the same tokens in a
question, a tool line and a call) and each tool is rendered as the call it asks for,
`- {"name": "convert", "arguments": {"value": number, ...}}: description` (`template="call"`;
`"compact"`, a signature line as OpenAI's harmony format renders tools, copied less well).
docs/agents.md ("Tools the model never saw") has what each choice bought, measured with
tidal/recipes/tool_probe.py. The demonstrations are cut into (text, trained) segments where the
rollout tokenizes (the prompt once, each policy turn, then only what the template adds), from
the real `ToolEnv`'s own observations.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import torch

from tidal.envs.base import Action
from tidal.envs.tool_arith import ToolArithEnv, make_rows
from tidal.recipes.tiny import build_model, save_model
from tidal.recipes.tool_model import (
    CHAT_TEMPLATE,
    build_tokenizer,
    call_text,
    guessed_answer,
    held_out_success,
    sft_train,
    teacher_turns,
)
from tidal.recipes.tool_worlds import VALUE_WORDS, World, WorldEnv, coined_word, make_worlds

# CHAT_TEMPLATE with each tool on one line as a signature,
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
# The same line shaped as the call the policy writes,
# `- {"name": "convert", "arguments": {"value": number, "from_unit": string}}: description`: the
# name and each argument name follow the very text they follow in a call, so copying them is
# what an induction head does (the token after the earlier occurrence of the same context).
CALL_LINES = (
    "{% for t in tools %}{% set f = t['function'] if t.get('function') else t %}"
    "{% set params = f.get('parameters') or {} %}{% set required = params.get('required') or [] %}"
    "- {{ '{' }}\"name\": {{ f['name'] | tojson }}, \"arguments\": {{ '{' }}"
    "{% for k, p in (params.get('properties') or {}).items() %}{% if not loop.first %}, {% endif %}"
    "{{ k | tojson }}{% if k not in required %}?{% endif %}: "
    "{% if p.get('enum') %}{{ p['enum'] | map('tojson') | join(' | ') }}"
    "{% elif p.get('type') is string %}{{ p['type'] }}{% elif p.get('type') %}{{ p['type'] | join(' | ') }}"
    "{% else %}any{% endif %}"
    "{% endfor %}{{ '}}' }}: {{ f.get('description') or '' }}{{ '\\n' }}{% endfor %}"
)
CALL_TEMPLATE = COMPACT_TEMPLATE.replace(TOOL_LINES, CALL_LINES)
TEMPLATES = {"compact": COMPACT_TEMPLATE, "call": CALL_TEMPLATE}



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


def scripted_segments(items: list[tuple[Any, list[str]]], chat_template: str = COMPACT_TEMPLATE
                      ) -> list[list[tuple[str, bool]]]:
    """`episode_segments` of (env, turns) pairs."""
    render = render_only_tokenizer(chat_template)

    async def all_of() -> list:
        return [await episode_segments(render, env, turns) for env, turns in items]

    return asyncio.run(all_of())


def tokenize_segments(tokenizer, segments: list[tuple[str, bool]], every: bool = False
                      ) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of (text, trained) segments; `every`: every token trained."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, trained in segments:
        new = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += new
        mask += [trained or every] * len(new)
    return ids, mask


def training_examples(tokenizer, segments: list[list[tuple[str, bool]]], drills: int, prompt_loss: bool,
                      rng: random.Random) -> list[tuple[list[int], list[bool]]]:
    """The SFT examples of both phases: the demonstrations' segments and `drills` copy drills
    (drawn with `rng`), tokenized; `prompt_loss`: every token trained."""
    segments = segments + [copy_drill(rng) for _ in range(drills)]
    return [tokenize_segments(tokenizer, episode, every=prompt_loss) for episode in segments]


def _drill_item(rng: random.Random) -> Any:
    """A name, an argument name or a value, as the worlds draw them."""
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randint(0, 10 ** rng.randint(1, 4))
    if kind == 1:
        return rng.choice(VALUE_WORDS)
    return "_".join(coined_word(rng) for _ in range(rng.choice((1, 1, 2))))


def copy_drill(rng: random.Random) -> list[tuple[str, bool]]:
    """A copying drill, every token trained: the user names a tool and its arguments in prose,
    the assistant writes them as the call (or lists words back as JSON). Names and values stand
    in other contexts on the two sides (after a space; after a quote), as a schema's and a
    question's do against a call, so what the drill teaches is to find and copy, the skill a
    call of a tool never seen needs and that the worlds alone taught too slowly
    (docs/agents.md, "Tools the model never saw")."""
    if rng.random() < 0.3:
        words = [_drill_item(rng) for _ in range(rng.randint(2, 6))]
        user, answer = "Repeat: " + " ".join(map(str, words)), json.dumps(words)
    else:
        name = "_".join(coined_word(rng) for _ in range(rng.choice((1, 2))))
        args = {coined_word(rng): _drill_item(rng) for _ in range(rng.randint(1, 3))}
        said = ", ".join(f"{k} {v}" for k, v in args.items())
        user, answer = f"Call {name} with {said}.", call_text(name, args)
    return [(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n", True), (answer + "<|im_end|>", True)]


def both_success(model, tokenizer, val: dict[str, list], k: int = 4) -> dict:
    """`held_out_success` on the `tool_arith` rows and on held-out generated worlds (tools never
    trained on), flattened as `arith/...` and `worlds/...`."""
    out = {}
    for key, env in (("arith", ToolArithEnv), ("worlds", WorldEnv)):
        res = held_out_success(model, tokenizer, val[key], k=k, env=env)
        out.update({f"{key}/{m}": res.get(m) for m in ("accuracy", "pass_at_k", "failed", "tool_calls",
                                                        "tool_error_rate")})
    return out


def demonstration_items(seed: int, train_size: int, world_frac: float, eval_n: int, habits: dict[str, float],
                        rng: random.Random, wide: bool = False) -> tuple[dict[str, list], list[tuple[Any, list[str]]]]:
    """The validation rows and the (env, scripted turns) demonstrations, shuffled: `world_frac`
    generated worlds (`wide` ones: tidal/recipes/world_phrasing.py), the rest `tool_arith`
    problems, each with a habit drawn from `habits` with `rng` (the same rows and worlds for any
    `rng`, only the habits and order differ). Validation worlds are plain ones either way."""
    n_worlds = round(train_size * world_frac)
    rows = make_rows("train", train_size - n_worlds + eval_n, seed=20_000 + seed)
    val = {"arith": rows[:eval_n], "worlds": [w.row() for w in make_worlds("test", eval_n, seed)]}
    names, weights = list(habits), list(habits.values())
    items = [(ToolArithEnv(r, seed=0), teacher_turns(r, rng.choices(names, weights)[0], rng)) for r in rows[eval_n:]]
    items += [(WorldEnv(w.row(), seed=0), world_turns(w, rng.choices(names, weights)[0], rng))
              for w in make_worlds("train", n_worlds, seed, wide=wide)]
    rng.shuffle(items)
    return val, items


def check_habits(habits: dict[str, float]) -> dict[str, float]:
    if abs(sum(habits.values()) - 1.0) > 1e-9 or set(habits) - {"tool", "direct", "malformed"}:
        raise ValueError(f"habits must be fractions of tool, direct, malformed summing to 1, got {habits}")
    return habits


def build_general_tool_model(
    out_dir: str | Path,
    seed: int = 0,
    steps: int = 2000,
    batch_size: int = 24,
    lr: float = 3e-3,
    warmup: int = 50,
    habits: dict[str, float] | None = None,
    world_frac: float = 0.85,
    eval_every: int = 0,
    eval_n: int = 60,
    train_size: int = 40000,
    vocab_size: int = 1024,
    evaluate=None,
    stop_after: int | None = None,
    tune_steps: int = 4500,
    tune_lr: float = 2e-3,
    tune_habits: dict[str, float] | None = None,
    template: str = "call",
    drill_frac: float = 0.6,
    words_apart: bool = True,
    prompt_loss: bool = True,
) -> dict:
    """Build tokenizer and model, warm-start them on generated tool worlds, copy drills and
    `tool_arith`, save an HF directory; return a summary (also in `tidal_build.json`).
    `stop_after` ends the first phase early, on the schedule of `steps` (and skips the second).

    `world_frac` of the demonstrations are generated worlds (tidal/recipes/tool_worlds.py), the
    rest `tool_arith` problems, and `drill_frac` × `train_size` copy drills (`copy_drill`) come
    on top. The teacher's habits, drawn per demonstration (`habits`, fractions): `tool`, the
    right call then the answer read from the result; `direct`, a hasty guess; `malformed`, a
    slipped call, the env's error, then a guess (in a world, half the time the right call).
    `prompt_loss`: every token is trained, the prompt's too (a question repeats its tool's topic
    and values, a description its name: more to copy). `words_apart`: the tokenizer never joins
    letters to what precedes them (`build_tokenizer`). Validation: a slice of `tool_arith`'s
    train split and held-out worlds, whose target tools are never trained on. A second phase
    (`tune_general_tool_model`, `tune_steps` > 0) continues on the same mixture drawn from wide
    worlds (tidal/recipes/world_phrasing.py), with a fresh schedule. docs/agents.md ("Tools the model never saw") has what each choice bought.
    """
    habits = check_habits(habits or {"tool": 0.8, "direct": 0.15, "malformed": 0.05})
    if not 0 <= world_frac <= 1 or template not in TEMPLATES:
        raise ValueError(f"world_frac must be in [0, 1] (got {world_frac}) and template one of {sorted(TEMPLATES)} "
                         f"(got {template!r})")
    random.seed(seed)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    val, items = demonstration_items(seed, train_size, world_frac, eval_n, habits, rng)
    t0 = time.time()
    segments = scripted_segments(items, TEMPLATES[template])
    corpus = [text for episode in segments[:3000] for text, _ in episode]
    tokenizer = build_tokenizer(corpus, vocab_size, chat_template=TEMPLATES[template], words_apart=words_apart)
    examples = training_examples(tokenizer, segments, round(train_size * drill_frac), prompt_loss, rng)
    record_s = time.time() - t0
    model = build_model(tokenizer, seed=seed)
    # a system turn with three tools and a few turns run to ~400 tokens (RoPE: no table to grow)
    model.config.max_position_embeddings = 1024
    evaluate = evaluate or both_success
    losses: list = []
    t0 = time.time()
    history = sft_train(model, tokenizer, examples, 0, val, evaluate, rng, steps=steps, batch_size=batch_size,
                        lr=lr, warmup=warmup, eval_every=eval_every, label="tool", log_every=50, losses=losses,
                        stop_after=stop_after)
    build_s = record_s + time.time() - t0
    save_model(model, tokenizer, out_dir)
    summary = {"seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "habits": habits,
               "world_frac": world_frac, "train_size": train_size, "vocab_size": len(tokenizer), "template": template,
               "drill_frac": drill_frac, "words_apart": words_apart, "prompt_loss": prompt_loss,
               "eval_n": eval_n, "stopped_after": min(steps, stop_after or steps), "record_s": round(record_s, 1),
               "build_s": round(build_s, 1), "cpu_s": round(time.process_time(), 1),
               "threads": torch.get_num_threads(), "losses": losses,
               "tokens_per_example": round(sum(len(t) for t, _ in examples) / len(examples), 1),
               "val": history[-1] if history else {}, "params": sum(p.numel() for p in model.parameters()),
               "history": history}
    (Path(out_dir) / "tidal_build.json").write_text(json.dumps(summary, indent=1))
    if tune_steps and not stop_after:
        return tune_general_tool_model(out_dir, out_dir, steps=tune_steps, lr=tune_lr, habits=tune_habits,
                                       eval_every=eval_every, evaluate=evaluate)
    return summary


def tune_general_tool_model(
    base_dir: str | Path,
    out_dir: str | Path,
    steps: int = 1000,
    lr: float = 2e-3,
    warmup: int = 50,
    habits: dict[str, float] | None = None,
    eval_every: int = 0,
    evaluate=None,
    stop_after: int | None = None,
    wide: bool = True,
) -> dict:
    """The second phase: continue the first phase's saved model (`base_dir`, with its
    `tidal_build.json`) on the same mixture (habits, unless `habits` is given; copy drills;
    prompt loss) but with `wide` worlds (tidal/recipes/world_phrasing.py: more name styles,
    question frames and result kinds), a fresh AdamW and schedule; save to `out_dir`, the first phase's summary
    kept in `tidal_build.json` with this phase's under `tune`."""
    from tidal.models import load_model, load_tokenizer

    base = json.loads((Path(base_dir) / "tidal_build.json").read_text())
    habits = check_habits(habits or base["habits"])
    cpu0 = time.process_time()
    seed = base["seed"]
    random.seed(seed + 1)
    torch.manual_seed(seed + 1)
    rng = random.Random(f"tune-{seed}")
    tokenizer, model = load_tokenizer(base_dir), load_model(base_dir)
    val, items = demonstration_items(seed, base["train_size"], base["world_frac"], base["eval_n"], habits, rng,
                                     wide=wide)
    t0 = time.time()
    examples = training_examples(tokenizer, scripted_segments(items, tokenizer.chat_template),
                                 round(base["train_size"] * base.get("drill_frac", 0.0)), base.get("prompt_loss", False),
                                 rng)
    losses: list = []
    history = sft_train(model, tokenizer, examples, 0, val, evaluate or both_success, rng, steps=steps,
                        batch_size=base["batch_size"], lr=lr, warmup=warmup, eval_every=eval_every, label="tune",
                        log_every=50, losses=losses, stop_after=stop_after)
    tune = {"steps": steps, "lr": lr, "warmup": warmup, "habits": habits, "wide": wide,
            "stopped_after": min(steps, stop_after or steps), "build_s": round(time.time() - t0, 1),
            "cpu_s": round(time.process_time() - cpu0, 1), "threads": torch.get_num_threads(), "losses": losses,
            "val": history[-1] if history else {}, "history": history}
    save_model(model, tokenizer, out_dir)
    summary = {**base, "tune": tune, "val": tune["val"],
               "build_s": round(base["build_s"] + tune["build_s"], 1), "cpu_s": round(base["cpu_s"] + tune["cpu_s"], 1)}
    (Path(out_dir) / "tidal_build.json").write_text(json.dumps(summary, indent=1))
    return summary
