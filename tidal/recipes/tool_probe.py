"""Two measures of whether a tiny tool model calls tools from their schemas (docs/agents.md,
"Tools the model never saw"): what RL needs, and why a model falls short of it.

`first_turn_calls`: the share of sampled first turns (T=1, as RL samples) that call a given
tool well-formed with arguments its schema accepts, through the real rollout and env; GRPO
has a signal on a task only where this is well above 0. `call_copy_losses`: the
teacher-forced loss of the *right* first call on generated worlds, per token, split by what
the token has to copy (the tool's name, its argument names from the signature line, the
values from the question) and the JSON around them. A model can write the format (low
`format` loss) and still invent names: the split says which part is missing, and a small gap
between trained and held-out worlds says that the model does not copy at all rather than
that it memorised the trained tools.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch

from tidal.recipes.tool_model import call_text
from tidal.recipes.tool_worlds import WorldEnv, make_worlds


def first_turn_calls(model_dir: str | Path, env_cls, tool: str, prompts: int = 12, samples: int = 4,
                     seed: int = 7, max_new_tokens: int = 64) -> float:
    """The fraction of sampled first turns on `prompts` held-out rows of `env_cls` (`samples`
    each) that call `tool` well-formed with arguments its schema accepts (status `ok`)."""
    from tidal.engines.torch_engine import TorchEngine
    from tidal.envs import loop_scoped
    from tidal.models import load_model, load_tokenizer, stop_token_ids
    from tidal.runtime.rollout import Rollout, group_specs
    from tidal.types import SamplingParams

    tok = load_tokenizer(model_dir)
    engine = TorchEngine(load_model(model_dir), tok.pad_token_id)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=stop_token_ids(tok))
    rollout = Rollout(tok, params, max_turns=1)
    rows = env_cls.rows("test", prompts, 0)
    try:
        eps = loop_scoped.run(rollout.run(group_specs(rows, env_cls, samples, seed, 0), engine, step=0))
    finally:
        engine.close()
    ok = [any(c.name == tool and c.status == "ok" for c in e.turns[0].tool_calls) for e in eps if e.turns]
    return sum(ok) / len(eps)


def _spans(call: str, name: str, args: dict) -> dict[str, list[tuple[int, int]]]:
    """Character spans of the call's name, argument names and values."""
    start = call.index('"name": "') + len('"name": "')
    spans: dict[str, list[tuple[int, int]]] = {"name": [(start, start + len(name))], "arg_name": [], "value": []}
    for k, v in args.items():
        at = call.index(f'"{k}": ')
        spans["arg_name"].append((at + 1, at + 1 + len(k)))
        text = json.dumps(v)
        v_at = call.index(text, at + len(k) + 3)
        spans["value"].append((v_at, v_at + len(text)))
    return spans


def call_copy_losses(model_dir: str | Path, split: str, n: int = 40, seed: int = 0) -> dict[str, float]:
    """Mean per-token loss (nats) of the right first call on `n` generated worlds of `split`
    ("train": tools the warm start saw; "test": held-out tools), split into the tool's name,
    argument names, values and the rest (`format`)."""
    from tidal.models import load_model, load_tokenizer
    from tidal.recipes.general_tool_model import render_only_tokenizer

    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    model.eval()
    render = render_only_tokenizer(tok.chat_template)
    sums: dict[str, list[float]] = {"name": [], "arg_name": [], "value": [], "format": []}
    for w in make_worlds(split, n, seed):
        spec = w.tools[w.target]
        env = WorldEnv(w.row())
        history = asyncio.run(env.reset())  # the env's own system turn and question
        prompt = render.apply_chat_template(history, tools=env.tools, add_generation_prompt=True, tokenize=False)
        call = call_text(spec.name, w.args)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        enc = tok(call, add_special_tokens=False, return_offsets_mapping=True)
        ids = p_ids + enc["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        spans = _spans(call, spec.name, w.args)
        for t, (a, b) in enumerate(enc["offset_mapping"]):
            pos = len(p_ids) + t
            kind = next((k for k, sp in spans.items() if any(a < e and b > s for s, e in sp)), "format")
            sums[kind].append(-logp[pos - 1, ids[pos]].item())
    return {k: round(sum(v) / len(v), 3) for k, v in sums.items() if v}
