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


# ---- bitnet serve (tests/serve_proc.py): one server per test module that asks for it -----------------------
@pytest.fixture(scope="module")
def server(request):
    """`bitnet serve --parallel 16` on the bundled model, a real subprocess on 127.0.0.1 (a test module's
    SERVER_ARGS replace the flags)."""
    from serve_proc import Server

    s = Server(*getattr(request.module, "SERVER_ARGS", ("--parallel", "16")))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on that server (no retries: a failure shows at once)."""
    openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install .[test])")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id
