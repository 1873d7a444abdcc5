"""Shared fixtures: tiny random models, loaded once per session and shared read-only by every test."""

from __future__ import annotations

import os
from collections.abc import Callable

# Tests never reach a hub, and wandb never goes online from a test. Set before anything imports
# huggingface_hub, which reads HF_HUB_OFFLINE once, at import (set later, a hub lookup waited ~45 s here).
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from specpolicy.models import LoadedModel, RandomInitSource  # noqa: E402

# Where tiny models live: CPU in CI; SPECPOLICY_TEST_DEVICE=cuda runs the engine's exactness tests on a GPU
# (tests/test_engine_parity.py and tests/test_engine_sampling.py place their tensors on this device).
DEVICE = torch.device(os.environ.get("SPECPOLICY_TEST_DEVICE", "cpu"))

# Small enough for CPU tests in milliseconds, large enough to have GQA (4 heads, 2 kv heads) and 4 layers
# to build layer-subset drafts from. intermediate_size is set because llama's default is 11008.
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512,
)


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., LoadedModel]:
    """`tiny_model(model_type="llama", seed=0, **config)` -> a cached tiny model; `config` overrides TINY.

    Models are eval-mode with frozen weights; tests must not modify them, because they are shared.
    """
    loaded: dict[tuple, LoadedModel] = {}

    def load(model_type: str = "llama", seed: int = 0, **config) -> LoadedModel:
        key = (model_type, seed, tuple(sorted(config.items())))
        if key not in loaded:
            source = RandomInitSource(model_type=model_type, config={**TINY, **config}, seed=seed, device=str(DEVICE))
            loaded[key] = source.load()
        return loaded[key]

    return load


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny-model tests: their ops are too small to split, and on a
    busy 2-core machine extra threads mostly spin (we measured 5-10x slower engine runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
