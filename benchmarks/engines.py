"""Generation throughput of tidal's engines against plain HF `generate`, side by side.

    python benchmarks/engines.py [--prompts 256] [--batch 64] [--engines torch,hf,vllm,vllm-server] [--passes 3]
                                 [--system-tokens 0] [--out benchmarks/results/engines.json]

Same prompts, same concurrency (`--batch` sequences decode at once in every engine: HF
gets the prompts in chunks of that size, the others a batch-size limit), same sampling
(temperature 1, per-request seeds; HF's global generator seeded at each pass, so that every
pass of an engine writes the same tokens), realistic variable lengths:
- `default`: the embedded 1M model on arithmetic prompts, stopping at its end-of-turn
  token (budget 64 tokens); lengths are whatever the model writes.
- `mid`: a 24M-parameter Qwen2 (hidden 512, 6 layers, random weights, the same
  tokenizer); random weights never stop by themselves, so each request gets a length
  drawn from a long-tailed (log-normal, median 24, max 128) distribution, enforced per
  row in every engine (HF: a per-row stopping criterion, which is how HF treats a row
  that produced EOS: it keeps computing it, padded, until the whole batch is done).
`--system-tokens N` puts one system turn of N tokens before every prompt (an agent's
instructions and tool descriptions are such a turn): the same for every engine.
Engines: `torch` is tidal's torch engine (on these Qwen2 models its lean decode step,
lean_decode.py); `torch-model` the same engine decoding through the model's own forward
(`lean_decode=False`), to show what the lean step is worth; `hf` plain `generate`.

Each engine runs `--rounds` times, alternating, every run in a fresh process: two threads
of one process that both run torch ops make libgomp keep two thread teams on two cores,
and then both are ~2.5x slower (docs/engines.md), so an engine that decodes on its own thread
(tidal's does) after another ran on the main thread would pay for the other. Each round's
tokens/s are kept; the median counts (this machine is shared), and so does the median over
rounds of torch / hf within a round (the two ran close in time). In a process the engine (or
HF's model) is loaded once and passes over the workload `--passes` + 1 times, as an RL loop
generates with one engine every step; the first pass warms up (and holds the torch engine's
one-time probe of its lean step), and tokens/s = generated tokens (up to and including the
stop token) / wall time of the median timed pass. Tokens per CPU second (all the process's
threads, same pass) are kept too: on a shared machine they move less than wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Before torch: the OpenMP defaults that `import tidal` sets (tidal/__init__.py) take effect only
# if libgomp has not loaded yet, and every process here (HF's too) runs with them, as a tidal run does.
import tidal  # noqa: F401

# isort: split
import torch

from tidal.engines.torch_engine import TorchEngine
from tidal.envs.arithmetic import ArithmeticConfig, make_problems
from tidal.models import DEFAULT_MODEL_DIR, load_model, load_tokenizer, stop_token_ids
from tidal.types import GenerationRequest, SamplingParams


def build_mid_model(out: Path) -> Path:
    from tidal.recipes.tiny import build_model

    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    model = build_model(tokenizer, hidden=512, layers=6, heads=8, kv_heads=4, seed=0)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


SYSTEM = "You are a careful calculator. Read the question, then give only the number. "


def workload(model_dir: Path, n: int, natural_stop: bool, seed: int = 0, system_tokens: int = 0) -> list[GenerationRequest]:
    tokenizer = load_tokenizer(model_dir)
    rows = make_problems(ArithmeticConfig(), "test", n, seed=seed)
    rng = random.Random(seed)
    stops = stop_token_ids(tokenizer) if natural_stop else ()
    system = []
    if system_tokens:  # one system turn shared by every prompt, as an agent's instructions and tools are
        text = SYSTEM * (system_tokens // len(tokenizer(SYSTEM)["input_ids"]) + 1)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:system_tokens]
        system = [{"role": "system", "content": tokenizer.decode(ids)}]
    reqs = []
    for i, row in enumerate(rows):
        text = tokenizer.apply_chat_template(system + row["prompt"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        budget = 64 if natural_stop else min(128, max(4, int(math.exp(rng.gauss(math.log(24), 0.8)))))
        reqs.append(GenerationRequest(str(i), ids, SamplingParams(max_new_tokens=budget, temperature=1.0,
                                                                  stop_token_ids=stops, seed=1000 + i)))
    return reqs


# Each runner loads its engine once and returns (generate, close): generate(requests) ->
# generated tokens. The child process times generate alone, pass after pass on the same engine,
# as an RL loop uses one engine for every step.
def torch_runner(model_dir: Path, batch: int, lean: bool = True):
    tokenizer = load_tokenizer(model_dir)
    engine = TorchEngine(load_model(model_dir), tokenizer.pad_token_id, max_batch_size=batch, lean_decode=lean)

    def generate(reqs: list[GenerationRequest]) -> int:
        return sum(len(r.token_ids) for r in engine.generate_sync(reqs))

    return generate, engine.close


def hf_runner(model_dir: Path, batch: int):
    from transformers import StoppingCriteria, StoppingCriteriaList

    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir).eval()
    pad = tokenizer.pad_token_id

    def generate(reqs: list[GenerationRequest]) -> int:
        torch.manual_seed(0)  # HF samples from torch's global generator: every pass writes the same tokens
        total = 0
        for start in range(0, len(reqs), batch):
            chunk = reqs[start : start + batch]
            L = max(len(r.prompt_ids) for r in chunk)
            ids = torch.full((len(chunk), L), pad, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, r in enumerate(chunk):
                ids[i, L - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
                attn[i, L - len(r.prompt_ids) :] = 1
            budgets = torch.tensor([r.params.max_new_tokens for r in chunk])
            stops = list(chunk[0].params.stop_token_ids)

            class PerRowLength(StoppingCriteria):  # a row past its own length is done, like EOS
                def __call__(self, input_ids, scores, _start=L, _budgets=budgets, **kwargs):  # this chunk's, bound now
                    return (input_ids.shape[1] - _start) >= _budgets

            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, max_new_tokens=int(budgets.max()), pad_token_id=pad,
                                     eos_token_id=stops or None,
                                     stopping_criteria=StoppingCriteriaList([PerRowLength()]))
            for i, r in enumerate(chunk):
                gen = out[i, L:].tolist()
                n = len(gen)
                for j, t in enumerate(gen):
                    if t in stops:
                        n = j + 1
                        break
                total += min(n, r.params.max_new_tokens)
        return total

    return generate, lambda: None


def vllm_runner(model_dir: Path, batch: int, mode: str):
    import asyncio

    from tidal.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, mode=mode, max_batch_size=batch)
    loop = asyncio.new_event_loop()  # one loop for every pass, as a rollout's

    def generate(reqs: list[GenerationRequest]) -> int:
        return sum(len(r.token_ids) for r in loop.run_until_complete(engine.generate(reqs)))

    def close() -> None:
        engine.close()
        loop.close()

    return generate, close


RUNNERS = {"torch": torch_runner, "torch-model": lambda m, b: torch_runner(m, b, lean=False), "hf": hf_runner,
           "vllm": lambda m, b: vllm_runner(m, b, "in_process"),
           "vllm-server": lambda m, b: vllm_runner(m, b, "server")}


def run_one(engine: str, model_dir: Path, natural_stop: bool, prompts: int, batch: int,
            system_tokens: int = 0, passes: int = 3) -> tuple[int, float, float]:
    """One timed run in a fresh process (see the module docstring)."""
    out = subprocess.run([sys.executable, __file__, "--child", engine, str(model_dir), str(int(natural_stop)),
                          str(prompts), str(batch), str(system_tokens), str(passes)], check=True, capture_output=True,
                         text=True).stdout
    tokens, seconds, cpu_seconds = json.loads(out.strip().splitlines()[-1])
    return tokens, seconds, cpu_seconds


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        engine, model_dir, natural_stop, prompts, batch, system_tokens, passes = sys.argv[2:9]
        reqs = workload(Path(model_dir), int(prompts), natural_stop=natural_stop == "1", system_tokens=int(system_tokens))
        generate, close = RUNNERS[engine](Path(model_dir), int(batch))
        try:
            # The first pass warms up (allocations, oneDNN kernels per shape: the first 64-row
            # prefill took 140 ms instead of ~30; the torch engine's one-time probe of its lean
            # step): the later ones are what an RL loop that generates every step sees. Every
            # engine gets the same warm-up; the median timed pass counts.
            generate(reqs)
            timed = []
            for _ in range(int(passes)):
                cpu0, t0 = time.process_time(), time.perf_counter()
                tokens = generate(reqs)
                timed.append((time.perf_counter() - t0, time.process_time() - cpu0))
        finally:
            close()
        seconds, cpu_seconds = sorted(timed)[len(timed) // 2]
        print(json.dumps([tokens, seconds, cpu_seconds]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engines", default="torch,torch-model,hf")
    p.add_argument("--models", default="default,mid")
    p.add_argument("--system-tokens", type=int, default=0, help="a shared system turn of this many tokens")
    p.add_argument("--passes", type=int, default=3, help="timed passes per process (after one warm-up); the median counts")
    p.add_argument("--out", default="benchmarks/results/engines.json")
    ns = p.parse_args()
    engines = ns.engines.split(",")
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "torch_threads": torch.get_num_threads(), "prompts": ns.prompts, "batch": ns.batch,
                     "system_tokens": ns.system_tokens, "passes": ns.passes,
                     "openmp_env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"default": DEFAULT_MODEL_DIR, "mid": build_mid_model(Path(tmp) / "mid")}
        for name in ns.models.split(","):
            model_dir = Path(dirs[name])
            params = sum(p.numel() for p in load_model(model_dir).parameters())
            runs: dict[str, list[dict]] = {e: [] for e in engines}
            for rnd in range(ns.rounds):
                for eng in engines[rnd % len(engines):] + engines[:rnd % len(engines)]:  # order rotates
                    tokens, dt, cpu = run_one(eng, model_dir, name == "default", ns.prompts, ns.batch, ns.system_tokens,
                                              ns.passes)
                    runs[eng].append({"tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt, 1),
                                      "cpu_seconds": round(cpu, 3), "tokens_per_cpu_s": round(tokens / cpu, 1)})
                    print(f"{name} round {rnd + 1} {eng}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.0f} tok/s "
                          f"({cpu:.2f} CPU s)", flush=True)
            results["models"][name] = {"parameters": params, "engines": {
                e: {"median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 1),
                    "median_tokens_per_cpu_s": round(statistics.median(r["tokens_per_cpu_s"] for r in rs), 1),
                    "rounds": rs}
                for e, rs in runs.items()}}
            if {"torch", "hf"} <= set(engines):  # within a round the two ran minutes apart at most
                per_round = [t["tokens_per_s"] / h["tokens_per_s"] for t, h in zip(runs["torch"], runs["hf"])]
                results["models"][name]["torch_over_hf_per_round"] = [round(r, 3) for r in per_round]
                results["models"][name]["median_torch_over_hf_per_round"] = round(statistics.median(per_round), 3)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(results, indent=1))
    print("\n| model | " + " | ".join(engines) + " | torch / hf (medians) | torch / hf (median of rounds) |")
    print("| --- | " + " | ".join("---" for _ in engines) + " | --- | --- |")
    for name, r in results["models"].items():
        tps = {e: r["engines"][e]["median_tokens_per_s"] for e in engines}
        cells = [f"{tps[e]:.0f}" for e in engines]
        ratio = tps["torch"] / tps["hf"] if {"torch", "hf"} <= set(engines) else float("nan")
        per_round = r.get("median_torch_over_hf_per_round", float("nan"))
        print(f"| {name} ({r['parameters'] / 1e6:.1f}M) | " + " | ".join(cells) + f" | {ratio:.2f}× | {per_round:.2f}× |")


if __name__ == "__main__":
    main()
