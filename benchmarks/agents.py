"""Multi-turn rollout throughput against single-turn, on the same torch engine, side by side.

    python benchmarks/agents.py [--rounds 3] [--episodes 128] [--turns 4] [--tokens 64]
                                [--tool-ms 20 50] [--max-batch 64] [--out benchmarks/results/agents.json]

What it compares (generated tokens per second of wall clock, one `Rollout.run` each):

- single-turn: every episode generates `turns x tokens` tokens in one turn;
- multi-turn: every episode has `turns` turns of `tokens` tokens; after each turn but the
  last, a tool answers after asyncio.sleep of a uniform 20-50 ms (a slow tool: a sandbox
  run, an HTTP call), and its answer is appended as a `tool` message; the next turn's
  prompt is the whole conversation so far (the torch engine has no prefix cache, so each
  turn prefills it again);
- multi-turn without the prefix cache (`TorchEngine(prefix_cache_bytes=0)`): each turn
  prefills the whole conversation again.

The same number of tokens is generated in every run: lengths are forced with
`max_new_tokens` and no stop tokens (every turn runs to its limit). The model is a Qwen2 with
random weights (hidden 256, 4 layers, the embedded model's tokenizer; built as in
benchmarks/async.py, with its special tokens blocked: `build_random_qwen2`), so the text is
random; nothing is scored. Each round runs the three in
turn, the order reversed every other round; the table gives medians over rounds. The process
is pinned to one core (`--cores`): an engine has one device. Two
workloads: more episodes than batch slots (`--episodes`, default 2 x max batch: while some
episodes wait on their tool the others fill the batch, the regime an agentic run is in) and
exactly one batch of episodes (every episode's tool wait is visible, nobody can fill it).
torch threads = 1. Also reported per run: decode steps, mean rows per step, prefilled tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tidal.envs.base import Action, StepResult
from tidal.types import SamplingParams

SPECIAL_BLOCK_CONSTANT = 3.0  # see build_random_qwen2


def build_random_qwen2(out: Path, hidden: int = 256, layers: int = 4, seed: int = 0) -> Path:
    """A Qwen2 with random weights and the embedded model's tokenizer, saved as an HF folder,
    that never samples a special token.

    A random model samples the chat template's special tokens (<|im_start|>, <|im_end|>) as
    often as any other, and a turn that contains one does not render back the way it was
    generated (its text skips them), so the rollout would start a new segment (a prefix break,
    a full prefill) on about a third of the turns — an artifact no trained model shows. The
    head is untied and blocks them (as benchmarks/async.py biases its stop token): dimension 0
    of every input embedding is a constant A, large against the other dimensions (init std
    0.02), so after the final RMSNorm every position carries about the same positive value h_0
    (≈ sqrt(hidden)) there; the special tokens' output rows hold -A at dimension 0, so their
    logits are lowered by about A·h_0 at every position.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tidal.models import DEFAULT_MODEL_DIR, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), max_position_embeddings=2048,
        tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = SPECIAL_BLOCK_CONSTANT
        model.lm_head.weight[tokenizer.all_special_ids, 0] = -SPECIAL_BLOCK_CONSTANT
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


class ToolEnv:
    """`turns` turns; after each but the last a tool that takes `tool_ms` (uniform) to answer."""

    name = "bench_tool"

    def __init__(self, index: int, seed: int, turns: int, tool_ms: tuple[float, float]):
        self.index, self.turns, self.tool_ms = index, turns, tool_ms
        self.rng = random.Random(seed)
        self.turn = 0
        self.tool_s = 0.0

    async def reset(self):
        return [{"role": "user", "content": f"Task {self.index}: use the tool, then answer."}]

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        if self.turn >= self.turns:
            return StepResult(done=True)
        t0 = time.perf_counter()
        await asyncio.sleep(self.rng.uniform(*self.tool_ms) / 1000)
        self.tool_s += time.perf_counter() - t0
        return StepResult(messages=[{"role": "tool", "content": f"result {self.rng.randrange(10_000)}"}], done=False)

    async def close(self) -> None:
        pass


class OneTurnEnv(ToolEnv):
    name = "bench_one_turn"

    async def step(self, action: Action) -> StepResult:
        return StepResult(done=True)


def run_once(engine, tokenizer, multi: bool, episodes: int, turns: int, tokens: int, tool_ms, seed: int) -> dict:
    from tidal.runtime.rollout import EpisodeSpec, Rollout

    kind = "multi" if multi else "single"
    per_turn = tokens if multi else turns * tokens
    rollout = Rollout(tokenizer, SamplingParams(max_new_tokens=per_turn, temperature=1.0), max_turns=turns if multi else 1)
    env_cls = ToolEnv if multi else OneTurnEnv
    envs = [env_cls(i, seed * 100_003 + i, turns, tool_ms) for i in range(episodes)]
    specs = [EpisodeSpec(env, f"{kind}-{i}", f"g{i}", str(i), seed * 100_003 + i) for i, env in enumerate(envs)]
    steps0, sampled0, prefill0 = engine.decode_steps, engine.sampled_tokens, engine.prefill_tokens
    t0 = time.perf_counter()
    eps = asyncio.run(rollout.run(specs, engine, step=0))
    wall = time.perf_counter() - t0
    bad = [ep for ep in eps if not ep.status.trainable]
    assert not bad, f"{kind}-turn: {len(bad)} episodes failed, first: {bad[0].error}"
    generated = [sum(t.end - t.start for t in ep.turns) for ep in eps]
    assert set(generated) == {turns * tokens}, f"{kind}-turn: generated lengths {sorted(set(generated))}"
    steps = engine.decode_steps - steps0
    return {
        "wall_s": wall, "prefill_tokens": engine.prefill_tokens - prefill0, "generated_tokens": sum(generated), "tokens_per_s": sum(generated) / wall,
        "decode_steps": steps, "mean_batch_rows": (engine.sampled_tokens - sampled0) / max(steps, 1),
        "tool_s_per_episode": statistics.mean(e.tool_s for e in envs),
        "prefix_breaks": sum(ep.metrics.get("rollout/prefix_breaks", 0.0) for ep in eps),
        "context_tokens_last_turn": statistics.mean(len(ep.tokens) - (ep.turns[-1].end - ep.turns[-1].start)
                                                    for ep in eps),
    }


# (label, engine, multi-turn?)
RUNS = [
    ("single-turn", "default", False),
    ("multi-turn", "default", True),
    ("multi-turn, no prefix cache", "no prefix cache", True),
]


def workload(engines: dict, tokenizer, name: str, episodes: int, args) -> dict:
    runs: list[dict] = []
    for r in range(args.rounds):
        for label, engine, multi in RUNS if r % 2 == 0 else RUNS[::-1]:
            eng = engines[engine]
            res = run_once(eng, tokenizer, multi, episodes, args.turns, args.tokens, tuple(args.tool_ms), seed=r)
            res.update(run=label, round=r)
            runs.append(res)
            print(f"  [{name}] round {r} {label:58s} {res['tokens_per_s']:7.0f} tok/s  wall {res['wall_s']:6.2f} s  "
                  f"steps {res['decode_steps']:4d}  mean batch {res['mean_batch_rows']:5.1f}  "
                  f"prefill {res['prefill_tokens']:6d}", flush=True)
    labels = [label for label, _, _ in RUNS]
    med = {k: statistics.median(x["tokens_per_s"] for x in runs if x["run"] == k) for k in labels}
    return {
        "workload": name, "episodes": episodes, "runs": runs, "median_tokens_per_s": med,
        "ratio_to_single_turn": {k: med[k] / med["single-turn"] for k in labels},
        "median_mean_batch_rows": {k: statistics.median(x["mean_batch_rows"] for x in runs if x["run"] == k)
                                   for k in labels},
        "median_prefill_tokens": {k: statistics.median(x["prefill_tokens"] for x in runs if x["run"] == k)
                                  for k in labels},
    }


def markdown(results: list[dict], args) -> str:
    labels = [label for label, _, _ in RUNS]
    lines = [(f"Torch engine, random Qwen2 (hidden {args.hidden}, {args.layers} layers), max batch {args.max_batch}; "
              f"{args.turns} turns x {args.tokens} tokens vs 1 turn x {args.turns * args.tokens} tokens; tool "
              f"{args.tool_ms[0]:g}-{args.tool_ms[1]:g} ms after each turn but the last; generated tokens/s, "
              f"median of {args.rounds} rounds (ratio to single-turn; mean rows per decode step)."), "",
             "| episodes | " + " | ".join(labels) + " |",
             "| --- |" + " --- |" * len(labels)]
    for w in results:
        m, q, b = w["median_tokens_per_s"], w["ratio_to_single_turn"], w["median_mean_batch_rows"]
        cells = [f"{m[k]:.0f} ({q[k]:.2f}; {b[k]:.0f} rows)" for k in labels]
        lines.append(f"| {w['episodes']} ({w['workload']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=None, help="default: 2 x --max-batch")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per turn")
    ap.add_argument("--tool-ms", type=float, nargs=2, default=[20.0, 50.0])
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cores", type=int, default=1, help="CPU cores the process may use (0: all)")
    ap.add_argument("--out", default="benchmarks/results/agents.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cores:
        # One engine has one device: on a CPU it would otherwise take more cores than a GPU it stands for.
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cores])

    from tidal.engines.torch_engine import TorchEngine
    from tidal.models import load_model, load_tokenizer

    with tempfile.TemporaryDirectory(prefix="tidal-agents-bench-") as tmp:
        model_dir = build_random_qwen2(Path(tmp) / "model", args.hidden, args.layers)
        tokenizer = load_tokenizer(model_dir)
        model = load_model(model_dir)
    engines = {"default": TorchEngine(model, tokenizer.pad_token_id, args.max_batch),
               "no prefix cache": TorchEngine(model, tokenizer.pad_token_id, args.max_batch, prefix_cache_bytes=0)}
    for eng in engines.values():  # warm-up (allocator, first-call costs)
        run_once(eng, tokenizer, True, 8, 2, 8, (1.0, 2.0), seed=99)
    many = args.episodes or 2 * args.max_batch
    results = [workload(engines, tokenizer, "more episodes than batch slots", many, args),
               workload(engines, tokenizer, "one batch of episodes", args.max_batch, args)]
    table = markdown(results, args)
    out = {"config": vars(args), "machine": {"python": platform.python_version(), "torch": torch.__version__,
                                             "cpu": platform.processor() or platform.machine(),
                                             "cores_used": sorted(os.sched_getaffinity(0)),
                                             "load_average_at_end": os.getloadavg()},
           "workloads": results, "table": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print()
    print(table)


if __name__ == "__main__":
    main()
