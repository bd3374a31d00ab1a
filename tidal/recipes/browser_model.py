"""Build the tiny browser model: a tiny Qwen2 with a locally trained tokenizer and the tool
model's chat template, warm-started on the browser env's `click_button` family with imperfect
habits.

`tidal build-browser-model` rebuilds `tidal/models/assets/tiny-browser` deterministically (same
seed and machine type → same weights; thread count changes float summation order), as
tidal/recipes/tool_model.py does for tiny-tool, whose tokenizer recipe, chat template and SFT
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
from tqdm import tqdm

from tidal.engines.torch_engine import TorchEngine
from tidal.envs.base import Action
from tidal.envs.browser.env import BrowserEnv
from tidal.envs.browser.pool import BrowserConfig, BrowserPool
from tidal.envs.browser.scripted import resolve_ref, snapshot_elements
from tidal.envs.browser.tasks import OBJECTS, VERBS, button_labels, make_tasks
from tidal.envs.tools import assistant_message, parse_tool_calls
from tidal.models import stop_token_ids
from tidal.recipes.tiny import build_model, save_model
from tidal.recipes.tool_model import CHAT_TEMPLATE, build_tokenizer, call_text, sft_batch, sft_train, shared_prefix
from tidal.runtime.evaluate import evaluate_engine
from tidal.runtime.rollout import Rollout
from tidal.types import SamplingParams

FAMILIES = ["click_button"]
ENV_ARGS: dict[str, Any] = {"actions": ["click", "done"], "max_turns": 3, "action_timeout_s": 5.0}  # as examples/browser.yaml
HABITS = ("right", "first", "malformed")
DEFAULT_HABITS = {"right": 0.5, "first": 0.5}  # `build_browser_model`'s, and the shipped model's
FORMS = ("named", "line", "quote")  # the right habit's turn (`teacher_turns`)
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
    snapshot's own tokens, so the ref is a copy of what follows the label there; "quote":
    `the "X" [ref=e7]`, the label after the instruction's own `the "` and then, token for token,
    the rest of its snapshot line, the lookup `lookup_pretrain` teaches), then clicks it;
    `first` clicks the first button of the page without reading further (right only when the
    target comes first); `malformed` slips (`malformed_call`), reads the env's error, then
    does as `first`. All end with `done`."""
    first = next(ref for role, _, ref in snapshot_elements(observation) if role == "button")
    if habit == "right":
        label = instructed_label(row)
        ref = resolve_ref(observation, "button", label)
        if form == "line":
            return [f'Target: "{label}", button "{label}" [ref={ref}]\n' + call_text("click", {"ref": ref}), DONE]
        if form == "quote":
            return [f'the "{label}" [ref={ref}]\n' + call_text("click", {"ref": ref}), DONE]
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


def _curriculum_train(model, tokenizer, steps: int, make, rng: random.Random, batch_size: int, lr: float,
                      level=lambda step: 0, desc: str = "curriculum") -> float:
    """AdamW on sequences from `make(rng, level)` -> (ids, loss mask), padded right (`sft_batch`);
    linear warm-up over 50 steps, then `lr`; a progress bar named `desc`. Returns the last
    batch's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    loss = torch.tensor(float("nan"))
    for step in tqdm(range(steps), desc=desc, unit="step", mininterval=5.0):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50)
        ids, _, labels = sft_batch([make(rng, level(step)) for _ in range(batch_size)], tokenizer.pad_token_id)
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return round(loss.item(), 4)


@torch.no_grad()
def _accuracy(model, tokenizer, examples: list[tuple[list[int], list[bool]]]) -> float:
    """Greedy next-token accuracy on the positions with loss (teacher-forced)."""
    ids, _, labels = sft_batch(examples, tokenizer.pad_token_id)
    model.eval()
    pred = model(ids).logits[:, :-1].argmax(-1)
    model.train()
    known = labels[:, 1:] != -100
    return round((pred[known] == labels[:, 1:][known]).float().mean().item(), 4)


def copy_pretrain(model, tokenizer, steps: int, rng: random.Random, batch_size: int = 32, lr: float = 1e-3,
                  span: int = 20) -> dict:
    """A copy by content (an induction head) before anything else: 0-`span` random tokens, a run
    of 6 to 2/3 `span` distinct tokens, 0-`span` random tokens, the run again; the loss on the
    repeat after its first token. The distance between run and repeat varies, so only a copy
    keyed on the token just read scores: "find where this token was, write what came next".

    It forms late and at once (docs/browser.md, "Why the first tiny models did not point"): at the
    builder's size, near chance until ~1700 steps, then 0.98 by ~1950. A fixed distance (the
    runs written back to back) is learned in 100 steps as a positional copy that does not
    carry over; longer spans (0-60) or lr 3e-3 kept it at chance for 1500 steps. Returns the
    final loss and the copy accuracy on fresh sequences."""
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]

    def make(r: random.Random, _level: int) -> tuple[list[int], list[bool]]:
        before, length, between = r.randint(0, span), r.randint(6, max(6, span * 2 // 3)), r.randint(0, span)
        run = r.sample(pool, length)
        ids = r.choices(pool, k=before) + run + r.choices(pool, k=between) + run
        return ids, [False] * (before + length + between + 1) + [True] * (length - 1)

    loss = _curriculum_train(model, tokenizer, steps, make, rng, batch_size, lr, desc="browser copy")
    check = random.Random(rng.random())
    return {"steps": steps, "loss": loss, "copy_accuracy": _accuracy(model, tokenizer, [make(check, 0) for _ in range(64)])}


class _SnapshotPieces:
    """Token ids of the pieces of a snapshot's button line, `- button "Renew invoice" [ref=e12]`,
    as the tokenizer splits the whole line: the lead (`- button "`), each label, the fill
    between label and ref (`" [ref=e`), each ref's digits, the end (`]` and the newline); and of
    the right turn's click on it, split around the ref's digits (`click_head`, `click_tail`). The
    lookup curriculum builds lines and queries from them, so what it teaches is keyed on the
    tokens the policy will read and write."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lead, self.label_ids, self.fill, self.end = None, {}, None, None
        for verb in VERBS:
            self.split(verb, 12)
            for obj in OBJECTS:
                self.split(f"{verb} {obj}", 12)
        self.query = self.encode('the "')
        head, tail = call_text("click", {"ref": "e12"}).split("12")
        self.click_head, self.click_tail = self.encode(head), self.encode(tail)
        turn = teacher_turns('- button "Renew invoice" [ref=e12]', {"solution": json.dumps(
            [{"action": "click", "role": "button", "name": "Renew invoice"}])}, "right", form="quote")[0]
        if self.encode(turn) != self.quote_turn("Renew invoice", 12)[0]:
            raise ValueError(f"the tokenizer splits the right turn {turn!r} otherwise than its snapshot line and "
                             "call; the lookup curriculum needs the label after `the \"`, and the ref's digits, "
                             "as the same tokens in all three")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def split(self, label: str, ref: int) -> None:
        lead, fill = '- button "', '" [ref=e'
        line = f"{lead}{label}{fill}{ref}]\n"
        enc = self.tokenizer(line, add_special_tokens=False, return_offsets_mapping=True)
        cuts = [len(lead), len(lead) + len(label), len(lead) + len(label) + len(fill), len(line) - 2]
        starts = [start for start, _ in enc["offset_mapping"]]
        if any(c not in starts for c in cuts):
            raise ValueError(f"the tokenizer merges across the parts of the snapshot line {line!r}; "
                             "the lookup curriculum needs label, fill and ref as separate tokens")
        ids, at = enc["input_ids"], [starts.index(c) for c in cuts]
        parts = [ids[:at[0]], ids[at[0]:at[1]], ids[at[1]:at[2]], ids[at[2]:at[3]], ids[at[3]:]]
        if self.lead is None:
            self.lead, self.fill, self.end = parts[0], parts[2], parts[4]
        elif (parts[0], parts[2], parts[4]) != (self.lead, self.fill, self.end):
            raise ValueError(f"the tokenizer splits the snapshot line {line!r} differently from the others")
        self.label_ids[label] = parts[1]

    def ref(self, number: int) -> list[int]:
        return self.encode(str(number))

    def quote_turn(self, label: str, number: int, fill: list[int] | None = None) -> tuple[list[int], list[bool]]:
        """`the "Renew invoice" [ref=e12]` and the click on e12 (`teacher_turns`' quote form), with
        `fill` between label and ref (the line's own when None); the loss mask marks the ref's
        digits, where looked up and where clicked."""
        ask = self.query + self.label_ids[label] + (self.fill if fill is None else fill)
        digits, between = self.ref(number), self.end + self.click_head
        ids = ask + digits + between + digits + self.click_tail
        mask = [False] * len(ask) + [True] * len(digits) + [False] * len(between) + [True] * len(digits)
        return ids, mask + [False] * len(self.click_tail)


def lookup_pretrain(model, tokenizer, steps: int, rng: random.Random, batch_size: int = 32, lr: float = 1e-3,
                    grow: int = 150, queries: int = 12) -> dict:
    """The lookup a click on the instructed button needs, taught on its own: a page of 3-8
    button lines with refs e2-e39, two-word labels with look-alikes as `click_button` draws
    them (or one verb each, half the pages), then `queries` right turns (`teacher_turns`' quote
    form): `the "Renew invoice" [ref=e12]` and the click on e12, whose loss is on the ref's
    digits, where looked up and where copied into the call. (With the lookup alone, a warm start
    named the instructed button's line right 184 times in 186 sampled turns, then clicked that
    ref in 38: the click was the turn's weak half.)

    The fill between label and ref grows. At level 0 the ref follows the label at once (a copy
    by content, `copy_pretrain`, solves it at step 1); each `grow` steps one more of the fill's
    tokens (`" [ref=e`) stands between them, up to the snapshot's own line. Trained on the whole
    line from the start, the tiny model stayed at the page's ref prior (0.5 for 400 steps after
    the copy; 0.4-0.45 for 900 from scratch); grown, every level was right 0.99 within 100
    steps of reaching it (docs/browser.md). Run `copy_pretrain` first. Returns the final loss
    and, at the full line, the accuracy on the turns' digits with one-word and two-word labels."""
    pieces = _SnapshotPieces(tokenizer)
    levels = len(pieces.fill)

    def make(r: random.Random, level: int, two: bool | None = None, exact: bool = False) -> tuple[list[int], list[bool]]:
        count = r.randint(3, 8)
        if (r.random() < 0.5) if two is None else two:
            labels = button_labels(r, r.choice(VERBS), r.choice(OBJECTS), count)
        else:  # one word each: the plainest key
            labels = r.sample(VERBS, count)
        refs = r.sample(range(2, 40), len(labels))
        level = level if exact else r.randint(0, level)  # the levels below stay in the mix
        fill = pieces.fill[len(pieces.fill) - level:] if level else []
        ids = [t for label, ref in zip(labels, refs)
               for t in pieces.lead + pieces.label_ids[label] + fill + pieces.ref(ref) + pieces.end]
        mask = [False] * len(ids)
        for _ in range(queries):  # the right turn: the ref looked up, then copied into the click
            k = r.randrange(len(labels))
            turn, on = pieces.quote_turn(labels[k], refs[k], fill)
            ids, mask = ids + turn, mask + on
        return ids, mask

    loss = _curriculum_train(model, tokenizer, steps, make, rng, batch_size, lr,
                             level=lambda step: min(levels, step // grow), desc="browser lookup")
    check = random.Random(rng.random())
    full = {two: _accuracy(model, tokenizer, [make(check, levels, two, exact=True) for _ in range(64)])
            for two in (False, True)}
    return {"steps": steps, "loss": loss, "levels": levels, "grow": grow,
            "ref_accuracy": full[False], "ref_accuracy_look_alikes": full[True]}


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


def _checked_recipe(habits: dict[str, float] | None, form: str, lookup_steps: int) -> dict[str, float]:
    """The teacher's habits (`DEFAULT_HABITS` when None), after a ValueError for a recipe that cannot build."""
    habits = habits or dict(DEFAULT_HABITS)
    if abs(sum(habits.values()) - 1.0) > 1e-9 or set(habits) - set(HABITS):
        raise ValueError(f"habits must be fractions of {', '.join(HABITS)} summing to 1, got {habits}")
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    if lookup_steps and form != "quote":
        raise ValueError(f"lookup_steps needs form='quote' (the lookup curriculum's turns are that form's), got {form!r}")
    return habits


def build_browser_model(
    out_dir: str | Path,
    seed: int = 0,
    steps: int = 400,
    batch_size: int = 16,
    lr: float = 1e-3,
    warmup: int = 30,
    habits: dict[str, float] | None = None,
    eval_every: int = 100,
    eval_n: int = 64,
    train_size: int = 364,
    vocab_size: int = 1024,
    concurrency: int = 16,
    evaluate=None,
    per_episode: int = 40,
    copy_steps: int = 2200,
    lookup_steps: int = 750,
    form: str = "quote",
) -> dict:
    """Build tokenizer and model, warm-start them on `click_button`, save an HF directory;
    return a summary (also written to `tidal_build.json`).

    The steps, each at its defaults (docs/browser.md, "The tiny-browser model"):
    - record `train_size - eval_n` episodes in Chromium (the rest of the train split's slice
      validates), each by one of the teacher's habits (`habits`, fractions, `DEFAULT_HABITS`
      when None; see `teacher_turns`): `right` names the instructed button by its snapshot line
      (`form`) and clicks it; `first` clicks the page's first button at once; `malformed` slips
      first;
    - add `per_episode - 1` relabelled copies of each (`demonstrations`): 300 recorded episodes
      give 12,000 demonstrations;
    - train a tokenizer on them, then run the two curricula on the fresh model: a copy by content
      (`copy_pretrain`, `copy_steps`), then the lookup of a ref by its label in a snapshot
      (`lookup_pretrain`, `lookup_steps`); 0 skips one;
    - SFT on the demonstrations (`steps`, `batch_size`, `lr`), validating every `eval_every`
      steps and at the end.

    The right habit is a copy (the label from the instruction, then the ref that follows it in
    the snapshot); without the curricula the tiny model learns its form but not the copy, and
    its success stays near the chance that the target is the first button. The result is
    deterministic for a seed and a torch thread count (recorded as `threads`).
    """
    habits = _checked_recipe(habits, form, lookup_steps)
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
    curricula = {}
    for name, run, steps_of in (("copy", copy_pretrain, copy_steps), ("lookup", lookup_pretrain, lookup_steps)):
        if steps_of:
            t0 = time.time()
            curricula[name] = {**run(model, tokenizer, steps_of, rng), "train_s": round(time.time() - t0, 1)}
            print(f"browser {name} curriculum: {json.dumps(curricula[name])}", flush=True)
    examples = [episode_tokens(tokenizer, e) for e in demos]
    prefix_len = shared_prefix(examples)
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
               "history": history, "threads": torch.get_num_threads(), "per_episode": per_episode,
               "demonstrations": len(demos), "curricula": curricula, "form": form}
    (Path(out_dir) / "tidal_build.json").write_text(json.dumps(summary, indent=1))
    return summary
