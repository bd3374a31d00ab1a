"""The default job in TRL's GRPOTrainer: the child of benchmarks/vs_trl.py, run by the TRL venv's
Python (`.venv-trl`, TRL and its own transformers), never imported by tidal.

    .venv-trl/bin/python benchmarks/_trl_job.py SPEC.json OUT.json

SPEC (written by vs_trl.py from tidal's own task and config): the model directory, the train
prompts in the order tidal's PromptSource draws them, the held-out rows, the hyperparameters and
the thread count. The reward is tidal's arithmetic score (tidal/rewards/arithmetic.py, loaded
from its file: it needs only `re`), correct + format, as tidal's default job sums them.

Every step is timed from the trainer's step begin to its end; the generation inside it
(`_generate_and_score_completions`) is timed apart. After each step the held-out rows are decoded
greedily and scored, off the clock. OUT gets one record per step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _trl_common import load_score, run_grpo


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    score = load_score(Path(spec["repo"]), "arithmetic.py")
    h = spec["hparams"]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    train = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in spec["train"]])
    held_out = spec["eval"]

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [sum(score(t, a).values()) for t, a in zip(texts, answer)]

    stop_ids = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} - {None})
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in held_out]

    @torch.no_grad()
    def greedy_accuracy(m) -> float:
        was = m.training
        m.eval()
        correct = 0
        for i in range(0, len(prompts), 100):
            enc = tok(prompts[i:i + 100], return_tensors="pt", padding=True, add_special_tokens=False)
            gen = m.generate(**enc, do_sample=False, max_new_tokens=h["max_new_tokens"], eos_token_id=stop_ids,
                             pad_token_id=tok.pad_token_id)
            for row, ids in zip(held_out[i:i + 100], gen[:, enc["input_ids"].shape[1]:]):
                correct += score(tok.decode(ids, skip_special_tokens=True), row["answer"])["correct"]
        m.train(was)
        return correct / len(prompts)

    run_grpo(spec, out_path, model=model, processing_class=tok, train=train, reward=reward,
             greedy_accuracy=greedy_accuracy, eval_at_start=False)


if __name__ == "__main__":
    main()
