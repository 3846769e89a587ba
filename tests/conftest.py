"""Shared fixtures: the built-in SmolLM2 target (fp32, converted once into the cache) and tiny models."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # shared helpers such as tests/rigged.py


@pytest.fixture(scope="session")
def smollm2():
    from ddtree.targets import load_target

    torch.manual_seed(0)
    return load_target("smollm2-135m", torch.float32)


@pytest.fixture(scope="session")
def tiny_target():
    from ddtree.targets import load_target

    return load_target("tiny-random", torch.float32)
