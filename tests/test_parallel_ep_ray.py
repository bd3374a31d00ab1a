"""`tidal train` (the default task) on Ray with 2 trainer ranks at (ep 2), on a tiny random
Qwen3-MoE with the default model's tokenizer: the controller sends the two ep ranks different
sequences (ep ranks are data ranks), the ranks exchange tokens with their experts inside Ray
actors, the engine gets the whole experts at each weight sync, and every step's numbers equal
those of one local process."""

from __future__ import annotations

import shutil

import pytest
from test_parallel_ep import build_tiny_moe
from test_placement import _train, config, metrics, ray_local, same_training  # noqa: F401 - ray_local: a fixture

from tidal.models import DEFAULT_MODEL_DIR


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_job_on_two_expert_parallel_ranks_trains_as_one_process(tmp_path, ray_local):  # noqa: F811
    model = tmp_path / "tiny-moe"
    build_tiny_moe(model, vocab_size=294, pad_token_id=0, eos_token_id=2)  # the default model's vocabulary
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy2(f, model / f.name)
    # an entropy bonus: the random model's rewards may all be equal (zero advantages), its gradient is not
    common = (f"model.path={model}", "train.mini_batches=2", "train.steps=2", "algorithm.entropy_coef=0.01")
    _train(config(tmp_path, *common, name="local"))
    ctl = _train(config(tmp_path, "placement.mode=ray", "placement.trainer_ranks=2", "train.parallel.ep=2", *common))
    assert ctl.trainer.world_size == 2 and ctl.trainer.version == 4 and ctl.trainer.dp_index == [0, 1]
    for a, b in zip(metrics(tmp_path / "local"), metrics(tmp_path / "run"), strict=True):
        assert a["grad_norm"] > 0
        # as tests/test_parallel_ray.py: sums in another order over 4 optimizer steps; a rank with the
        # wrong shard, a wrong combine or a missing reduction moves loss and grad_norm by percents
        same_training(a, b, tol=1e-4)
