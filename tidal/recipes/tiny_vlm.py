"""The tiny vision-language model's architecture: a Qwen2-VL built from a config, a locally trained
tokenizer with the vision special tokens, a chat template that renders image parts and tools,
and its image processor's settings. Saved as a normal Hugging Face directory, so the trainer,
the torch engine and vLLM load it as they would Qwen2-VL itself.

The warm-started model that ships in `tidal/models/assets/tiny-vlm` is built from this by
`tidal build-default-vlm` (tidal/recipes/vlm_build.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tidal.recipes.tiny import save_model
from tidal.recipes.tool_model import CHAT_TEMPLATE as TOOL_TEMPLATE
from tidal.recipes.tool_model import build_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# The content of a message: a string as it is; a list of parts, text parts as their text and image
# parts as Qwen2-VL's placeholder (one <|image_pad|> per image: tidal expands it).
_RENDER = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% elif content %}"
    "{% for p in content %}{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% elif p['type'] in ('image', 'image_url', 'input_image') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}{% endmacro %}"
)
# tiny-tool's template (tools, tool calls, tool responses), with user, system and tool contents
# rendered part by part.
CHAT_TEMPLATE = _RENDER + TOOL_TEMPLATE.replace("{{ m['content'] }}", "{{ render(m['content']) }}")

# Image processor settings: 14-pixel patches merged 2×2 into one token. Images are resized to
# between 56² and 224² pixels (4 to 64 tokens).
PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
    "min_pixels": 56 * 56, "max_pixels": 224 * 224, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
}

BASE_CORPUS = [
    "What color is the big square? Answer with <answer>red</answer>.",
    "How many red squares are there? <answer>3</answer>",
    "red green blue yellow purple orange white black gray square circle big small left right top bottom",
    "zero one two three four five six seven eight nine 0 1 2 3 4 5 6 7 8 9",
]


def build_vlm_tokenizer(corpus: list[str] | None = None, vocab_size: int = 512):
    """Byte-level BPE on `corpus` with ChatML's and the vision special tokens, and CHAT_TEMPLATE."""
    return build_tokenizer(list(corpus or BASE_CORPUS), vocab_size, extra_special=VISION_TOKENS,
                           chat_template=CHAT_TEMPLATE)


def build_vlm(tokenizer, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
              vision_width: int = 64, vision_layers: int = 2, seed: int = 0):
    """A randomly initialised Qwen2-VL: text head_dim 32 with mRoPE sections (4, 6, 6) (they sum
    to head_dim / 2), a vision tower `vision_width` wide of 14-pixel patches merged 2×2."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    head_dim = hidden // heads
    if head_dim != 32:
        raise ValueError(f"hidden / heads must be 32 (the mRoPE sections 4+6+6 = head_dim / 2), got {head_dim}")
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=1024,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=vision_layers, embed_dim=vision_width, hidden_size=hidden, num_heads=4, mlp_ratio=2,
                           patch_size=PROCESSOR["patch_size"], spatial_merge_size=PROCESSOR["merge_size"],
                           temporal_patch_size=PROCESSOR["temporal_patch_size"], in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


def save_vlm(model, tokenizer, out_dir: str | Path) -> Path:
    """An HF directory: weights, config, tokenizer and the image processor's config."""
    out = save_model(model, tokenizer, out_dir)
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=1))
    return out


def build_untrained_vlm(out_dir: str | Path, seed: int = 0, corpus: list[str] | None = None, **model_kwargs) -> Path:
    """Tokenizer and randomly initialised tiny VLM, saved as an HF directory (tests use it)."""
    tokenizer = build_vlm_tokenizer(corpus)
    return save_vlm(build_vlm(tokenizer, seed=seed, **model_kwargs), tokenizer, out_dir)
