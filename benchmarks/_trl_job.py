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

import importlib.util
import json
import sys
import time
from pathlib import Path


def load_score(repo: Path):
    spec = importlib.util.spec_from_file_location("tidal_arith_score", repo / "tidal" / "rewards" / "arithmetic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.score


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    import torch

    torch.set_num_threads(spec["threads"])
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    score = load_score(Path(spec["repo"]))
    h = spec["hparams"]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    train = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in spec["train"]])
    held_out = spec["eval"]

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [sum(score(t, a).values()) for t, a in zip(texts, answer)]

    timing = {"gen": 0.0}

    class Timed(GRPOTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            """tidal's warm-up: step s (from 0) at lr × min(1, (s + 1) / warmup), then constant
            (transformers' constant_with_warmup is one step behind: its first step has lr 0)."""
            if self.lr_scheduler is None:
                w = h["warmup_steps"]
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda s: min(1.0, (s + 1) / w) if w > 0 else 1.0)
                self._created_lr_scheduler = True
            return self.lr_scheduler

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                timing["gen"] += time.perf_counter() - t0

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

    records: list[dict] = []

    class PerStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, timing["gen"] = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, model=None, **kw):
            step_s = time.perf_counter() - self.t0
            t1 = time.perf_counter()
            acc = greedy_accuracy(model)
            records.append({"step": state.global_step, "step_s": step_s, "gen_s": timing["gen"],
                            "train_s": step_s - timing["gen"], "accuracy": acc, "eval_s": time.perf_counter() - t1})
            print(json.dumps(records[-1]), flush=True)

    config = GRPOConfig(
        output_dir=str(out_path.parent / "trl-out"), max_steps=spec["steps"], seed=spec["seed"],
        per_device_train_batch_size=h["micro_batch"], gradient_accumulation_steps=h["accum"],
        num_generations=h["samples_per_prompt"], max_completion_length=h["max_new_tokens"],
        temperature=h["temperature"], top_p=1.0, top_k=0,
        learning_rate=h["lr"],
        adam_beta1=h["betas"][0], adam_beta2=h["betas"][1], weight_decay=h["weight_decay"],
        max_grad_norm=h["grad_clip"], loss_type="dapo", beta=h["kl_coef"], epsilon=h["clip_low"],
        epsilon_high=h["clip_high"], scale_rewards="group", num_iterations=1, shuffle_dataset=False,
        use_cpu=True, bf16=False, fp16=False, report_to=[], save_strategy="no", logging_steps=1,
        disable_dropout=True, log_completions=False, dataloader_num_workers=0,
        gradient_checkpointing=h["activation_checkpointing"],  # TRL's default is on, tidal's off
    )
    trainer = Timed(model=model, reward_funcs=[reward], args=config, train_dataset=train, processing_class=tok,
                    callbacks=[PerStep()])
    trainer.train()
    import transformers

    out_path.write_text(json.dumps({"trl": trl.__version__, "transformers": transformers.__version__,
                                    "torch": torch.__version__, "steps": records}, indent=1))


if __name__ == "__main__":
    main()
