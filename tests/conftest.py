"""Shared fixtures: a randomly initialised tiny model directory (seconds to build)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tidal.models.tiny import build_untrained

    torch.set_num_threads(2)
    return build_untrained(tmp_path_factory.mktemp("tiny") / "model", hidden=64, layers=2, heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from tidal.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def tool_tokenizer():
    """The embedded tiny tool model's tokenizer (tidal/models/assets/tiny-tool)."""
    from tidal.models import load_tokenizer
    from tidal.models.tool_model import TOOL_MODEL_DIR

    return load_tokenizer(TOOL_MODEL_DIR)
