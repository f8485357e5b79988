"""The fixtures and hooks of every test (the repository's conftest.py loads them): a fresh seed per
test for Python's, numpy's and torch's generators, named in a failing test's report, and GPU tests
skipped where there is no CUDA GPU."""

import os
import random
import secrets
import sys

import numpy as np
import pytest

SEED_VARIABLE = "KVCACHED_TEST_SEED"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def fresh_seed(bits: int = 32) -> int:
    """A seed of ``bits`` bits, fresh each run; $KVCACHED_TEST_SEED replays one."""
    return int(os.environ.get(SEED_VARIABLE) or secrets.randbits(bits))


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """Every test's random data comes from one seed, fresh each run ($KVCACHED_TEST_SEED replays
    one): Python's, numpy's and torch's global generators are seeded with it, ``rng`` is made
    from it, and a failing test's report names it."""
    value = fresh_seed()
    random.seed(value)
    np.random.seed(value)
    if "torch" in sys.modules:          # imported by the test modules that use it
        sys.modules["torch"].manual_seed(value)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = dict(item.user_properties).get("seed")
    if report.failed and seed is not None:
        report.sections.append(("seed", f"this test ran with seed {seed}; replay it with {SEED_VARIABLE}={seed}"))
