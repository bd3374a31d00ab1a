"""What the two TRL children share (benchmarks/_trl_job.py, benchmarks/_trl_vlm_job.py): run by the TRL
venv's Python (`.venv-trl`), never imported by tidal, and importing nothing of tidal's but a reward file.

`run_grpo` trains with TRL's GRPOTrainer under the benchmark's equal settings: tidal's warm-up (TRL's
own `constant_with_warmup` is one step behind: its first step has lr 0), the generation inside each
step timed apart (`_generate_and_score_completions`), gradient checkpointing as tidal's
`train.activation_checkpointing` (TRL's default is on, tidal's off), and the held-out greedy accuracy
after every step (and before the first, with `eval_at_start`), off the clock. OUT gets one record per
step and the versions.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path


def load_score(repo: Path, reward_file: str):
    """`score` of one of tidal's reward files (tidal/rewards/<reward_file>), loaded from the file: it
    needs only the standard library."""
    spec = importlib.util.spec_from_file_location(f"tidal_score_{Path(reward_file).stem}",
                                                  repo / "tidal" / "rewards" / reward_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.score


def run_grpo(spec: dict, out_path: Path, *, model, processing_class, train, reward, greedy_accuracy,
             eval_at_start: bool) -> None:
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    h = spec["hparams"]
    timing = {"gen": 0.0}
    records: list[dict] = []

    class Timed(GRPOTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            """tidal's warm-up: step s (from 0) at lr × min(1, (s + 1) / warmup), then constant."""
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

    class PerStep(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            if eval_at_start:
                t1 = time.perf_counter()
                records.append({"step": 0, "accuracy": greedy_accuracy(model), "eval_s": time.perf_counter() - t1})
                print(json.dumps(records[-1]), flush=True)

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
    trainer = Timed(model=model, reward_funcs=[reward], args=config, train_dataset=train,
                    processing_class=processing_class, callbacks=[PerStep()])
    trainer.train()
    out_path.write_text(json.dumps({"trl": trl.__version__, "transformers": transformers.__version__,
                                    "torch": torch.__version__, "steps": records}, indent=1))
