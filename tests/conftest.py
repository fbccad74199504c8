"""Shared fixtures. Tests never download anything: models are generated here or shipped in models/."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def rng_seed():
    return int(os.environ.get("BITNET_TEST_SEED", "1234"))
