"""The tiny Qwen2-VL with random weights, sharpened, for the tests that compare log-probs with images
(tests/test_vlm_engine.py, tests/test_vlm_vllm.py).

With the raw initialisation attention is near uniform, and decoding at token-count positions or
showing a red square instead of a purple one moves a log-prob by ~3e-3 only. Scaling up the
query/key projections and the embeddings (and, with `vision=True`, the vision tower's patch embedding
and output) and jittering norms and biases makes those mistakes move it by ~0.4 and ~0.2.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tidal.models import load_model
from tidal.recipes.tiny_vlm import build_untrained_vlm


def sharpened_vlm(out: Path, *, vision: bool, seed: int = 3) -> Path:
    """Build the untrained tiny VLM into `out`, sharpen it (module docstring) and save it there."""
    d = build_untrained_vlm(out, seed=seed)
    model = load_model(d)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and ("q_proj" in name or "k_proj" in name):
                p.mul_(6)
            if "embed_tokens" in name:
                p.mul_(4)
            if vision and ("visual.patch_embed" in name or "visual.merger.mlp.2" in name):
                p.mul_(3 if "patch_embed" in name else 8)
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(d)
    return d
