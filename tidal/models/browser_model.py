"""Build the tiny browser model: a tiny Qwen2 with a locally trained tokenizer and the tool
model's chat template, warm-started on the browser env's `click_button` family with imperfect
habits.

`tidal build-browser-model` rebuilds `tidal/models/assets/tiny-browser` deterministically (same
seed and machine type → same weights; thread count changes float summation order), as
tidal/models/tool_model.py does for tiny-tool, whose tokenizer recipe, chat template and SFT
loss it reuses.

The demonstrations are episodes of the real `BrowserEnv` (one shared `BrowserPool`, several
episodes at once) with only the `click` and `done` tools (a short system turn), played by a
scripted teacher that reads the accessibility snapshot; the observations are the env's own.
The episodes are recorded first and tokenized afterwards, exactly as the rollout tokenizes
them (the tokenizer is trained on the recorded text, so the browser runs once).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import torch

from tidal.envs.base import Action
from tidal.envs.browser.env import BrowserEnv
from tidal.envs.browser.pool import BrowserConfig, BrowserPool
from tidal.envs.browser.scripted import resolve_ref, snapshot_elements
from tidal.envs.browser.tasks import OBJECTS, VERBS, button_labels, make_tasks
from tidal.envs.tools import assistant_message, parse_tool_calls
from tidal.models.tiny import build_model, save_model
from tidal.models.tool_model import CHAT_TEMPLATE, _shared_prefix, build_tokenizer, call_text, sft_train

BROWSER_MODEL_DIR = Path(__file__).parent / "assets" / "tiny-browser"
FAMILIES = ["click_button"]
ENV_ARGS: dict[str, Any] = {"actions": ["click", "done"], "max_turns": 3, "action_timeout_s": 5.0}  # as examples/browser.yaml
HABITS = ("right", "first", "malformed")
DONE = call_text("done", {})


# --------------------------------------------------------------------------------------------
# the teacher


def instructed_label(row: dict[str, Any]) -> str:
    """The label of the button the task asks for (its solution's one click)."""
    return json.loads(row["solution"])[0]["name"]


def malformed_call(label: str, ref: str, slip: int) -> str:
    """One of the slips seen in real tool use: broken JSON, a tool that is not offered, the
    button's label where its ref belongs, a call that is never closed."""
    if slip == 0:
        return f'<tool_call>{{"name": "click", "arguments": {{"ref": "{ref}"}}</tool_call>'
    if slip == 1:
        return call_text("press", {"ref": ref})
    if slip == 2:
        return call_text("click", {"ref": label})
    return f'<tool_call>{{"name": "click", "arguments": {{"ref": "{ref}"}}}}'


def teacher_turns(observation: str, row: dict[str, Any], habit: str, slip: int = 0, form: str = "named") -> list[str]:
    """The scripted policy turns of one episode, from the first observation (the page and its
    refs; after a click the page is the env's "Submitted" page, so the rest is fixed).

    `right` names the instructed button and its ref (`form` "named": `"X" is e7.`; "line": the
    label, then the button's line of the snapshot, `Target: "X", button "X" [ref=e7]`, in the
    snapshot's own tokens, so the ref is a copy of what follows the label there), then clicks
    it; `first` clicks the first button of the page without reading further (right only when
    the target comes first); `malformed` slips (`malformed_call`), reads the env's error, then
    does as `first`. All end with `done`."""
    first = next(ref for role, _, ref in snapshot_elements(observation) if role == "button")
    if habit == "right":
        label = instructed_label(row)
        ref = resolve_ref(observation, "button", label)
        if form == "line":
            return [f'Target: "{label}", button "{label}" [ref={ref}]\n' + call_text("click", {"ref": ref}), DONE]
        return [f'"{label}" is {ref}.\n' + call_text("click", {"ref": ref}), DONE]
    if habit == "first":
        return [call_text("click", {"ref": first}), DONE]
    if habit == "malformed":
        return [malformed_call(instructed_label(row), first, slip), call_text("click", {"ref": first}), DONE]
    raise ValueError(f"unknown habit {habit!r} (habits: {', '.join(HABITS)})")


async def record_episode(row: dict[str, Any], habit: str, slip: int, pool: BrowserPool,
                         env_args: dict[str, Any] | None = None, form: str = "named") -> dict[str, Any]:
    """One teacher episode in the real env: the reset's messages and tools, each turn's text
    with the env's answer to it (the assistant message as the env parsed it, the observation
    messages), and the reward."""
    env = BrowserEnv(row, 0, pool=pool, **(env_args or ENV_ARGS))
    try:
        messages = await env.reset()
        steps, reward = [], 0.0
        for i, text in enumerate(teacher_turns(messages[-1]["content"], row, habit, slip, form)):
            out = await env.step(Action(text, turn=i))
            steps.append({"text": text, "assistant": out.assistant_message or {"role": "assistant", "content": text},
                          "messages": out.messages})
            if out.done:
                reward = out.reward
                break
        return {"task_id": row["task_id"], "solution": row["solution"], "habit": habit, "messages": messages,
                "tools": env.tools, "steps": steps, "reward": reward}
    finally:
        await env.close()


def record_episodes(rows: list[dict[str, Any]], habits: list[str], slips: list[int], concurrency: int = 8,
                    browser: dict[str, Any] | None = None, form: str = "named") -> list[dict[str, Any]]:
    """`record_episode` for every row, `concurrency` at a time on one pool; in row order."""
    async def all_of() -> list[dict[str, Any]]:
        pool = BrowserPool(BrowserConfig.model_validate(browser or {"browsers": 1, "contexts_per_browser": concurrency}))
        try:
            out: list[dict[str, Any]] = []
            for i in range(0, len(rows), concurrency):
                chunk = zip(rows[i:i + concurrency], habits[i:i + concurrency], slips[i:i + concurrency])
                out += await asyncio.gather(*(record_episode(r, h, s, pool, form=form) for r, h, s in chunk))
            return out
        finally:
            await pool.close()

    return asyncio.run(all_of())


# A button of the snapshot, one line: `- button "Save order" [ref=e7]` (click_button's labels
# never need YAML's quoting).
_BUTTON_LINE = re.compile(r'^(\s*- button ")([^"\n]+)(" \[ref=e\d+\])$', re.MULTILINE)


def relabel_episode(episode: dict[str, Any], rng: random.Random, form: str = "named") -> dict[str, Any]:
    """A new demonstration from a recorded `right` or `first` episode: fresh labels on the
    page's buttons and a fresh target in the instruction, the teacher's turns played again on
    the new page.

    On a `click_button` page only the labels change what the policy sees: the snapshot with
    other labels on the same buttons is the one the env shows for that page (the labels appear
    only as the buttons' names; the refs follow the page's structure), and what the env
    answers to a click or `done` is the same page whatever was clicked. So one recorded
    episode yields many copy exercises for the cost of recording it once."""
    habit = episode["habit"]
    if habit not in ("right", "first"):
        raise ValueError(f"only right and first episodes can be relabelled, not {habit!r}")
    user = episode["messages"][-1]["content"]
    old_target = instructed_label(episode)
    instruction, sep, observation = user.partition("\n\n")
    lines = _BUTTON_LINE.findall(observation)
    if not sep or f'"{old_target}"' not in instruction or len(lines) < 2:
        raise ValueError(f"episode {episode['task_id']}: not a click_button page this can relabel")
    while True:  # the labels of a page with as many buttons as this one
        verb, obj = rng.choice(VERBS), rng.choice(OBJECTS)
        target, order = f"{verb} {obj}", button_labels(rng, verb, obj, len(lines))
        if len(order) == len(lines):
            break
    labels = iter(order)
    observation = _BUTTON_LINE.sub(lambda m: m.group(1) + next(labels) + m.group(3), observation)
    solution = json.dumps([{"action": "click", "role": "button", "name": target}])
    content = instruction.replace(f'"{old_target}"', f'"{target}"') + sep + observation
    steps = []
    for i, text in enumerate(teacher_turns(observation, {"solution": solution}, habit, form=form)):
        steps.append({"text": text, "assistant": assistant_message(parse_tool_calls(text, id_prefix=f"call_{i}")),
                      "messages": copy.deepcopy(episode["steps"][i]["messages"])})
    reward = 1.0 if habit == "right" or order[0] == target else 0.0
    return {**episode, "messages": [*episode["messages"][:-1], {**episode["messages"][-1], "content": content}],
            "steps": steps, "solution": solution, "reward": reward}


def demonstrations(episodes: list[dict[str, Any]], per_episode: int, rng: random.Random,
                   form: str = "named") -> list[dict[str, Any]]:
    """Each recorded episode and `per_episode - 1` relabelled copies of it (`relabel_episode`);
    a `malformed` one, whose error observation quotes what it typed, repeated as recorded. The
    habits' shares stay those recorded."""
    out = []
    for ep in episodes:
        out.append(ep)
        for _ in range(per_episode - 1):
            out.append(ep if ep["habit"] == "malformed" else relabel_episode(ep, rng, form))
    return out


def induction_pretrain(model, tokenizer, steps: int, rng: random.Random, batch_size: int = 32, length: int = 40,
                       lr: float = 3e-3) -> dict:
    """A copy curriculum before any demonstration: runs of `length` random tokens of the
    vocabulary, each written twice, the loss on the repeat. Clicking the instructed button is
    two copies (the label from the instruction, the ref after that label in the snapshot); from
    demonstrations alone the tiny model never learned to copy (800 SFT steps: the label it had
    written 5 tokens earlier copied 5-11% of the time), while on this curriculum it copies a
    run exactly within 100 steps.

    What it learns is a positional copy, not a copy by content: the repeat is always `length`
    tokens after the run, and the tiny model learns "the token `length - 1` back". Moved by 10
    tokens (a run of 30, or 10 random tokens between run and repeat), its copy accuracy was 0.0
    (measured after 150 steps, docs/browser.md, "Why the tiny model does not point"). Returns the
    final loss, the copy accuracy on fresh runs and `shifted_copy_accuracy`, the same with 10
    random tokens between run and repeat."""
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]

    def batch(n: int, gap: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        runs = torch.tensor([rng.sample(pool, length) for _ in range(n)])
        between = torch.tensor([rng.choices(pool, k=gap) for _ in range(n)], dtype=runs.dtype).view(n, gap)
        seq = torch.cat([runs, between, runs], 1)
        labels = seq.clone()
        labels[:, : length + gap + 1] = -100  # the first run, the gap, the repeat's first token cannot be known
        return seq, labels

    def accuracy(gap: int) -> float:
        seq, labels = batch(64, gap)
        pred = model(seq).logits[:, :-1].argmax(-1)
        known = labels[:, 1:] != -100
        return round((pred[known] == labels[:, 1:][known]).float().mean().item(), 4)

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50)
        seq, labels = batch(batch_size)
        logits = model(seq).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        copy, shifted = accuracy(0), accuracy(10)
    return {"steps": steps, "loss": round(loss.item(), 4), "copy_accuracy": copy, "shifted_copy_accuracy": shifted}


def episode_tokens(tokenizer, episode: dict[str, Any]) -> tuple[list[int], list[bool]]:
    """Tokens and loss mask of a recorded episode, tokenized as the rollout does: the prompt
    once, each policy turn as its own tokens + `<|im_end|>`, then only the text the template
    adds for the env's answer."""
    history, tools = episode["messages"], episode["tools"]
    rendered = tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    mask = [False] * len(ids)
    for step in episode["steps"]:
        turn_ids = tokenizer(step["text"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids += turn_ids
        mask += [True] * len(turn_ids)
        if not step["messages"]:  # the episode's last turn
            break
        rendered += step["text"] + "<|im_end|>"
        history = [*history, step["assistant"], *step["messages"]]
        after = tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=False)
        if not after.startswith(rendered):
            raise AssertionError(f"the chat template does not render the teacher's turn as written: {step['text']!r}")
        new = tokenizer(after[len(rendered):], add_special_tokens=False)["input_ids"]
        ids += new
        mask += [False] * len(new)
        rendered = after
    return ids, mask


def episode_texts(episodes: list[dict[str, Any]]) -> list[str]:
    """Texts for the tokenizer: the system turn once, then each episode's whole conversation
    after it (the system turn repeated would only skew the merges toward it)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    # a throwaway tokenizer object only to render the template (no vocabulary needed)
    render = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    render.chat_template = CHAT_TEMPLATE
    texts: list[str] = []
    for ep in episodes:
        history = [*ep["messages"]]
        for step in ep["steps"]:
            history += [step["assistant"], *step["messages"]]
        text = render.apply_chat_template(history, tools=ep["tools"], tokenize=False)
        system, _, rest = text.partition("<|im_end|>\n")
        texts += ([system + "<|im_end|>\n"] if not texts else []) + [rest]
    return texts


# --------------------------------------------------------------------------------------------
# evaluation and the build


def held_out_success(model, tokenizer, rows, k: int = 4, max_new_tokens: int = 48,
                     env_args: dict[str, Any] | None = None) -> dict:
    """Greedy success and pass@k on `rows` through the same rollout and env as `tidal eval`
    (the env's verifier is the reward)."""
    from tidal.engines.torch_engine import TorchEngine
    from tidal.models import stop_token_ids
    from tidal.runtime.evaluate import evaluate_engine
    from tidal.runtime.rollout import Rollout
    from tidal.types import SamplingParams

    # every episode of an evaluation runs at once: a context for each, none waits for a slot
    env_args = {**ENV_ARGS, "browser": {"browsers": 1, "contexts_per_browser": 64, "acquire_timeout_s": 600},
                **(env_args or {})}
    model.eval()
    engine = TorchEngine(model, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tokenizer))
    try:
        res = evaluate_engine(engine, Rollout(tokenizer, params, max_turns=env_args["max_turns"]), rows,
                              functools.partial(BrowserEnv, **env_args), k=k)
    finally:
        engine.close()
    model.train()
    return res


def draw_habits(n: int, habits: dict[str, float], rng: random.Random) -> tuple[list[str], list[int]]:
    """A habit and a slip kind (`malformed_call`) per demonstration."""
    names, weights = list(habits), list(habits.values())
    drawn = [rng.choices(names, weights)[0] for _ in range(n)]
    return drawn, [rng.randrange(4) for _ in range(n)]


def build_browser_model(
    out_dir: str | Path,
    seed: int = 0,
    steps: int = 600,
    batch_size: int = 16,
    lr: float = 3e-3,
    warmup: int = 30,
    habits: dict[str, float] | None = None,
    eval_every: int = 0,
    eval_n: int = 64,
    train_size: int = 1500,
    vocab_size: int = 1024,
    concurrency: int = 16,
    evaluate=None,
    per_episode: int = 1,
    induction_steps: int = 0,
    form: str = "named",
) -> dict:
    """Build tokenizer and model, warm-start them on `click_button`, save an HF directory;
    return a summary (also written to `tidal_build.json`).

    The teacher has three habits, drawn per demonstration (`habits`, fractions; see
    `teacher_turns`): `right` names the instructed button and its ref and clicks it; `first`
    clicks the page's first button at once; `malformed` slips first. The right habit is a copy
    (the label from the instruction, then the ref that follows it in the snapshot); at the
    defaults the tiny model learns its form but not yet the copy (measured: the shipped model's
    `tidal_build.json` and docs/browser.md), so its success stays near the chance that the target
    is the first button. Validation uses a slice of the *train* split (`eval_every` 0: only at
    the end).

    Opt-in, for the copy (docs/browser.md, "The tiny-browser model"; the defaults leave the
    shipped recipe as it was): `per_episode` > 1 adds `per_episode - 1` relabelled copies of
    every recorded episode (`demonstrations`); `induction_steps` runs the copy curriculum
    (`induction_pretrain`) before the SFT; `form="line"` makes the right habit copy the button's
    snapshot line (`teacher_turns`).
    """
    habits = habits or {"right": 0.55, "first": 0.35, "malformed": 0.1}
    if abs(sum(habits.values()) - 1.0) > 1e-9 or set(habits) - set(HABITS):
        raise ValueError(f"habits must be fractions of {', '.join(HABITS)} summing to 1, got {habits}")
    if form not in ("named", "line"):
        raise ValueError(f"form must be 'named' or 'line', got {form!r}")
    random.seed(seed)
    torch.manual_seed(seed)
    rows = make_tasks("train", train_size, seed=30_000 + seed, families=FAMILIES)
    val, train = rows[:eval_n], rows[eval_n:]
    rng = random.Random(seed)
    t0 = time.time()
    episodes = record_episodes(train, *draw_habits(len(train), habits, rng), concurrency=concurrency, form=form)
    record_s = time.time() - t0
    teacher = {h: [e["reward"] for e in episodes if e["habit"] == h] for h in habits}
    demos = demonstrations(episodes, per_episode, rng, form)
    tokenizer = build_tokenizer(episode_texts(demos), vocab_size)
    model = build_model(tokenizer, seed=seed)
    # episodes with the tools' system turn, a page of buttons and three turns run to ~400 tokens
    model.config.max_position_embeddings = 1024
    induction = {}
    if induction_steps:
        t0 = time.time()
        induction = {**induction_pretrain(model, tokenizer, induction_steps, rng), "train_s": round(time.time() - t0, 1)}
        print(f"browser copy curriculum: {json.dumps(induction)}", flush=True)
    examples = [episode_tokens(tokenizer, e) for e in demos]
    prefix_len = _shared_prefix(examples)
    history = sft_train(model, tokenizer, examples, prefix_len, val, evaluate or held_out_success, rng,
                        steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, eval_every=eval_every,
                        label="browser")
    save_model(model, tokenizer, out_dir)
    summary = {"seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "habits": habits,
               "train_size": train_size, "families": FAMILIES, "env_args": ENV_ARGS, "vocab_size": len(tokenizer),
               "record_s": round(record_s, 1),
               "teacher_success": {h: round(sum(r) / len(r), 3) for h, r in teacher.items() if r},
               "tokens_per_episode": round(sum(len(t) for t, _ in examples) / len(examples), 1),
               "val": history[-1] if history else {}, "params": sum(p.numel() for p in model.parameters()),
               "history": history}
    if per_episode > 1 or induction_steps or form != "named":
        summary.update(per_episode=per_episode, demonstrations=len(demos), induction=induction, form=form)
    (Path(out_dir) / "tidal_build.json").write_text(json.dumps(summary, indent=1))
    return summary
