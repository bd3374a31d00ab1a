"""Hugging Face Hub ids as model.path (tidal/models/hub.py), offline, against a cache laid out as
huggingface_hub lays it out: models--org--name/{blobs,refs/main,snapshots/<commit>/...}."""

from __future__ import annotations

import hashlib
import os
import socket

import pytest

from tidal.models import DEFAULT_MODEL_DIR, ModelLoadError, load_model, load_tokenizer, resolve_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, repo_id: str, src=DEFAULT_MODEL_DIR):
    """The Hub cache of `repo_id` holding `src`'s files, as `snapshot_download` leaves it: each
    file a blob named by its hash, linked from the commit's snapshot folder; refs/main names the
    commit."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snap / f.name)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hub cache in tmp_path (HF_HUB_OFFLINE, as huggingface_hub parsed it)."""
    from huggingface_hub import constants

    from tidal.models import hub as tidal_hub

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tidal_hub._snapshot_dir.cache_clear()
    yield cache
    tidal_hub._snapshot_dir.cache_clear()


def test_hub_id_resolves_to_the_cached_snapshot_offline(hub):
    snap = hub_cache(hub, "tidal-test/tiny-arith")
    assert resolve_model_dir("tidal-test/tiny-arith") == snap
    tok = load_tokenizer("tidal-test/tiny-arith")
    model = load_model("tidal-test/tiny-arith")
    ref = load_model(DEFAULT_MODEL_DIR)
    assert tok.chat_template and all((a == b).all() for a, b in zip(model.parameters(), ref.parameters()))


def test_absent_hub_id_names_the_id_and_the_cache(hub):
    with pytest.raises(ModelLoadError) as e:
        resolve_model_dir("tidal-test/not-there")
    assert "`tidal-test/not-there`" in str(e.value) and str(hub) in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)


def test_unreachable_hub_falls_back_to_the_cache(hub, monkeypatch):
    """Not offline, but the Hub cannot be reached (its endpoint a closed port on loopback): the
    cached snapshot, as transformers does; an id not cached is an error naming both."""
    from huggingface_hub import constants

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    snap = hub_cache(hub, "tidal-test/tiny-arith")
    assert resolve_model_dir("tidal-test/tiny-arith") == snap
    with pytest.raises(ModelLoadError, match=r"`tidal-test/absent`.*could not be reached"):
        resolve_model_dir("tidal-test/absent")


def test_a_local_directory_wins_over_an_id(hub, tmp_path, monkeypatch):
    hub_cache(hub, "org/model")
    local = tmp_path / "org" / "model"
    local.mkdir(parents=True)
    for f in DEFAULT_MODEL_DIR.iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("org/model") == local.relative_to(tmp_path)
