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


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """$DDTREE_CACHE at an empty folder, except for the converted targets: a fresh cache would convert the SmolLM2
    GGUF again (about 15 s) in every test that uses one."""
    from ddtree.targets import cache_dir, resolve_target

    resolve_target("tiny-random")  # converted (with SmolLM2, whose tokenizer it uses) into the real cache, once
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "targets").symlink_to(cache_dir() / "targets", target_is_directory=True)
    monkeypatch.setenv("DDTREE_CACHE", str(cache))
    return cache


def pytest_configure(config):
    """Convert the built-in targets once, before pytest-xdist starts its workers (make test): two workers converting
    into the same cache at once would replace the folder under the one already reading it."""
    if not hasattr(config, "workerinput"):  # the controlling process, or a run without workers
        from ddtree.targets import resolve_target

        resolve_target("tiny-random")  # converts SmolLM2 too, whose tokenizer it uses
