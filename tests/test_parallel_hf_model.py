"""The HF model/ directory written from the shards (tidal/trainer/parallel/hf_model.py), in one
process: how tensors are cut into files, and which names save_pretrained would write. The
multi-rank writes themselves (dp_shard 2, tp 2) are checked against one process's in
tests/test_parallel_resume.py."""

from __future__ import annotations

from tidal.trainer.parallel.hf_model import file_index, hf_names


def test_file_index_gives_every_rank_a_file_of_about_equal_bytes():
    sizes = {f"t{i}": s for i, s in enumerate([10, 30, 10, 10, 20, 10, 10])}  # 100 bytes
    idx = file_index(sizes, ranks=2, max_file_bytes=10**9)
    assert list(idx.values()) == sorted(idx.values())  # contiguous runs in the state dict's order
    per = {f: sum(sizes[n] for n in idx if idx[n] == f) for f in set(idx.values())}
    assert per == {1: 50, 2: 50}
    four = file_index(sizes, ranks=4, max_file_bytes=10**9)
    assert set(four.values()) == {1, 2, 3, 4}
    assert max(sum(sizes[n] for n in four if four[n] == f) for f in range(1, 5)) <= 40


def test_file_index_splits_past_the_file_size_and_never_makes_an_empty_file():
    sizes = {f"t{i}": 10 for i in range(10)}
    assert set(file_index(sizes, ranks=1, max_file_bytes=30).values()) == {1, 2, 3, 4}  # 100 bytes, <= 30 a file
    assert file_index({"a": 5, "b": 5}, ranks=8, max_file_bytes=10**9) == {"a": 1, "b": 2}  # fewer tensors than ranks
    big = file_index({"a": 1, "huge": 100, "c": 1}, ranks=3, max_file_bytes=50)
    assert len(set(big.values())) == 3 and big["huge"] not in (big["a"], big["c"])


def test_hf_names_leave_out_the_tied_head_as_save_pretrained_does(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    from tidal.models import load_model

    model = load_model(tiny_model_dir)
    assert model.config.tie_word_embeddings
    keys = list(model.state_dict())
    names = hf_names(model, model.state_dict())
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert "lm_head.weight" in keys and set(names.values()) == saved and "lm_head.weight" not in saved
    assert all(k == v for k, v in names.items())


def test_hf_names_rename_a_vlm_language_model_as_save_pretrained_does(tmp_path):
    from safetensors import safe_open

    from tidal.models import load_model
    from tidal.recipes.tiny_vlm import build_untrained_vlm

    model = load_model(build_untrained_vlm(tmp_path / "vlm"))
    names = hf_names(model, model.state_dict())
    model.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert set(names.values()) == saved
    assert any(k != v for k, v in names.items())  # some weight is renamed: the test covers a renaming


def test_a_model_whose_saving_converts_weights_is_left_to_the_gathering_path(tmp_path):
    from test_parallel_ep import build_tiny_moe

    from tidal.models import load_model

    build_tiny_moe(tmp_path)
    model = load_model(tmp_path)
    assert any(p.dim() == 3 for p in model.parameters())  # fused experts, split per expert on saving
    assert hf_names(model, model.state_dict()) is None


def test_a_critic_saved_in_several_files_keeps_its_value_head(tiny_model_dir, tmp_path):
    import torch

    from tidal.trainer.critic import load_value_model

    critic = load_value_model(tiny_model_dir, "float32", "cpu")
    assert not critic.score.weight.any()  # a base model: a fresh head, zeroed
    with torch.no_grad():
        critic.score.weight.fill_(0.5)
    critic.save_pretrained(tmp_path, max_shard_size="100KB")  # several files and an index, as sharded ranks write
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    assert torch.equal(load_value_model(tmp_path, "float32", "cpu").score.weight, critic.score.weight)
