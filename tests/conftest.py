"""Shared fixtures. Tests never download anything: models are generated here or shipped in models/."""
import os

import pytest


@pytest.fixture(scope="session")
def rng_seed():
    return int(os.environ.get("BITNET_TEST_SEED", "1234"))


@pytest.fixture
def isa(request):
    """Parametrize with indirect=True over kernel paths: the test runs with that path forced, then the best path
    and the default thread count come back."""
    from bitnet_cpu.simd import _kernels as K

    K.set_isa(request.param)
    yield request.param
    K.set_isa(None)
    K.set_num_threads(0)
