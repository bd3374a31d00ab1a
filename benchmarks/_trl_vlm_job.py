"""A vision-language GRPO job in TRL's GRPOTrainer: the child of benchmarks/vlm_vs_trl.py, run by the TRL
venv's Python (`.venv-trl`, TRL and its own transformers), never imported by tidal.

    .venv-trl/bin/python benchmarks/_trl_vlm_job.py SPEC.json OUT.json

SPEC (written by vlm_vs_trl.py from tidal's own task and config): the model directory (the embedded
tiny Qwen2-VL), the train rows in the order tidal's PromptSource draws them (question, picture as a
PNG path, answer), the held-out rows, the hyperparameters and the thread count. The dataset has
TRL's multimodal shape: a conversational prompt (one user turn, the question) and an `image`
column; TRL puts the picture before the question (`prepare_multimodal_messages`), where tidal's
rows have it. The reward is tidal's image-task score (tidal/rewards/vision.py, loaded from its file:
it needs only `re`), correct + 0.1 format, summed as tidal sums a task's reward parts.

What had to change for TRL to run this model here (all inside this file, nothing in TRL):
- The processor. There is no usable torchvision on this machine, and `AutoProcessor` (what TRL
  builds by default) fails: Qwen2VLProcessor's constructor takes a video processor, which needs
  torchvision. `processor()` builds transformers' PIL image processor
  (`Qwen2VLImageProcessorPil`) from the model's preprocessor_config.json, as tidal does, and an
  image-only subclass of `Qwen2VLProcessor` (its constructor without the video processor) holds
  it with the tokenizer and the chat template; it is passed as `processing_class`. Images are
  processed by the same transformers code as in tidal's venv.
- The learning-rate schedule: tidal's warm-up, and the timing of generation apart
  (benchmarks/_trl_common.py, shared with the text job).
- Activation (gradient) checkpointing follows tidal's `train.activation_checkpointing` (off by
  default) instead of TRL's default (on): the same gradients, one forward pass less per update.
No TRL or transformers source is patched.

Every step is timed from the trainer's step begin to its end; the generation inside it is timed
apart. Before the first step and after each step the held-out pictures are decoded greedily and
scored, off the clock; that decoding bans the four vision special tokens, as tidal's does (TRL's
own sampling during training suppresses only `<|image_pad|>`), and passes the processor's
`mm_token_type_ids` to `generate`, as TRL's own generation does: without them transformers 5.25's
Qwen2-VL `generate` raises no error but computes other positions for the picture (measured: the
starting weights' held-out accuracy on vlm_color 0.105 instead of the 0.045 tidal's engine and a
forward pass with mRoPE positions both give). OUT gets one record per step
(step 0: the starting weights, no timing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _trl_common import load_score, run_grpo

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PROCESSOR_KEYS = {"min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean",
                  "image_std", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb", "size",
                  "resample"}


def processor(model_dir: str, tok):
    """The model's processor without torchvision (module docstring): the PIL image processor from
    preprocessor_config.json, the tokenizer and the chat template, no video processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.video_processor = None

    cfg = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    images = Qwen2VLImageProcessorPil(**{k: v for k, v in cfg.items() if k in PROCESSOR_KEYS})
    return ImageOnlyQwen2VLProcessor(image_processor=images, tokenizer=tok, chat_template=tok.chat_template)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    score = load_score(Path(spec["repo"]), "vision.py")
    h = spec["hparams"]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    proc = processor(spec["model"], tok)
    model = AutoModelForImageTextToText.from_pretrained(spec["model"], dtype=torch.float32)

    def picture(path: str):
        with Image.open(path) as img:
            return img.convert("RGB")

    train = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "image": picture(r["image"]),
                                "answer": r["answer"]} for r in spec["train"]])
    held_out = spec["eval"]
    eval_images = [picture(r["image"]) for r in held_out]

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [sum(score(t, a).values()) for t, a in zip(texts, answer)]

    stop_ids = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"), model.generation_config.eos_token_id}
                      - {None})
    banned = [tok.convert_tokens_to_ids(t) for t in VISION_TOKENS]
    eval_msgs = [[{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": r["question"]}]}]
                 for r, img in zip(held_out, eval_images)]

    @torch.no_grad()
    def greedy_accuracy(m) -> float:
        was = m.training
        m.eval()
        correct = 0
        for i in range(0, len(eval_msgs), 100):
            enc = proc.apply_chat_template(eval_msgs[i:i + 100], add_generation_prompt=True, tokenize=True,
                                           return_dict=True, processor_kwargs={
                                               "return_tensors": "pt", "padding": True, "padding_side": "left"})
            gen = m.generate(**enc, do_sample=False, max_new_tokens=h["max_new_tokens"], eos_token_id=stop_ids,
                             pad_token_id=tok.pad_token_id, suppress_tokens=banned)
            for row, ids in zip(held_out[i:i + 100], gen[:, enc["input_ids"].shape[1]:]):
                correct += score(tok.decode(ids, skip_special_tokens=True), row["answer"])["correct"]
        m.train(was)
        return correct / len(eval_msgs)

    run_grpo(spec, out_path, model=model, processing_class=proc, train=train, reward=reward,
             greedy_accuracy=greedy_accuracy, eval_at_start=True)


if __name__ == "__main__":
    main()
