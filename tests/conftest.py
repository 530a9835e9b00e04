"""Shared fixtures: tokenizers trained here, on text this machine has, and fresh random seeds
(the helpers behind them: tests/support/tables.py)."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from tests.support.tables import train_tokenizer


@pytest.fixture(scope="session")
def bytelevel_tokenizer():
    return train_tokenizer("bytelevel")


@pytest.fixture(scope="session")
def wordpiece_tokenizer():
    return train_tokenizer("whitespace", 1200)


@pytest.fixture
def rng():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed
    (TEST_RANDOM_SEED=N pytest ... runs with that seed)."""
    seed = int(os.environ.get("TEST_RANDOM_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"random seed {seed}", file=sys.stderr)
    random.seed(seed)
    return torch.Generator().manual_seed(seed)
