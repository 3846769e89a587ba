"""Shared fixtures: the built-in SmolLM2 target (fp32, converted once into the cache) and tiny models."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # shared helpers such as tests/rigged.py


@pytest.fixture(autouse=True)
def lightning_seed_stays_in_its_test():
    """Lightning's seed_everything (every in-process training run calls it) writes PL_GLOBAL_SEED and PL_SEED_WORKERS
    into os.environ, where Lightning reads them back (a strategy's reset_seed, seed_everything() with no seed) and
    where every subprocess a later test starts inherits them: each test's are undone after it."""
    saved = {name: os.environ.get(name) for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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


@pytest.fixture
def drawn_plots():
    """A test that reads a plot file (tau.png, ablate-*.png) asks for it: undrawn_plots then stands aside."""


@pytest.fixture
def undrawn_plots(request, monkeypatch):
    """Used by the files whose runs write plots again at every save or variant (pytestmark): laying out and drawing a
    figure takes ~0.25 s of CPU on a 2-core AVX2 EPYC, a third of a test of a few launches. The figure is still built
    from its rows (what could fail on odd rows fails there), undrawn: the file holds a marker, not a PNG, so a test
    that reads it without asking for drawn_plots fails."""
    if "drawn_plots" in request.fixturenames:
        return
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "tight_layout", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(Figure, "savefig", lambda self, file, **kwargs: file.write(b"not drawn (undrawn_plots)"))


@pytest.fixture
def sized_rows(monkeypatch):
    """TreeSizer.measure stubbed (10 ms a verify, 1 ms a row): the list it returns gets the max_rows each measurement
    was asked for, which is what a test of the adaptive size's wiring checks. A test of generate, bench or calibrate
    that is not about sizing takes it too: the real measurement costs about 1.5 s a run on a 2-core AVX2 EPYC."""
    from ddtree.sizing import TreeSizer

    asked = []

    def measure(cls, target, max_rows, **keywords):
        asked.append(max_rows)
        return cls(fixed_ms=10.0, row_ms=1.0)

    monkeypatch.setattr(TreeSizer, "measure", classmethod(measure))
    return asked


def pytest_configure(config):
    """Convert the built-in targets once, before pytest-xdist starts its workers (make test): two workers converting
    into the same cache at once would replace the folder under the one already reading it."""
    if not hasattr(config, "workerinput"):  # the controlling process, or a run without workers
        from ddtree.targets import resolve_target

        resolve_target("tiny-random")  # converts SmolLM2 too, whose tokenizer it uses


@pytest.fixture
def python_sigint():
    """SIGINT as a Python process at a terminal has it (KeyboardInterrupt), for a test that sends itself one: pytest-xdist
    starts its workers with SIGINT ignored, where such a test passed alone and failed under `make test`."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
