"""Shared fixtures. Tests never download anything: models are generated here or shipped in models/."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the checkout (its files, not imports)


@pytest.fixture(scope="session")
def rng_seed():
    return int(os.environ.get("BITNET_TEST_SEED", "1234"))
