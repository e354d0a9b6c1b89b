"""The engines the HTTP server is tested against, and the server over each.

`engine` is an EngineHarness (tests/server/harness.py). A test runs against the engines
its `engines` mark names, once each, and against "fake" when unmarked:

- "fake": the in-process FakeEngineClient of fake_engine.py (logprobs, counters, aborts);
- "zmq": the real AsyncEngineClient, the ZMQ protocol and a real tokenizer, against the
  scripted EngineCore of tests/ipc (it echoes the prompt, makes no logprobs and counts no
  tokens);
- "cluster": AsyncEngineClient over a launch.py cluster (a real EngineCore process and
  worker) of the tiny random Llama, fp32, started once per session.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from server import build_app
from tests.server.fake_engine import VOCAB_SIZE, FakeEngineClient
from tests.server.harness import API_KEY, EngineHarness, LiveServer

CLUSTER_MAX_MODEL_LEN = 512


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "engines(*names): run against each engine named (tests/server/conftest.py)"
    )


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("engines")
    if marker is not None and "engine" in metafunc.fixturenames:
        metafunc.parametrize("engine", marker.args, indirect=True, scope="module")


@pytest.fixture(scope="module")
def engine(request) -> EngineHarness:
    return request.getfixturevalue(f"{getattr(request, 'param', 'fake')}_engine")


@pytest.fixture(scope="module")
def fake_engine() -> EngineHarness:
    fake = FakeEngineClient()
    return EngineHarness(
        fake, fake.tokenizer, "fake-model", 512, fake.aborted.__contains__, VOCAB_SIZE
    )


@pytest.fixture(scope="module")
def zmq_engine():
    from ipc.client import AsyncEngineClient
    from ipc.tokenizer import Tokenizer
    from tests.ipc.client_fakes import FAIL_TOKEN, FakeEngine, tiny_tokenizer_path

    with FakeEngine() as fake:
        tokenizer = Tokenizer.from_pretrained(tiny_tokenizer_path())
        client = AsyncEngineClient(fake.address, tokenizer=tokenizer)
        # The model's vocabulary: FAIL_TOKEN must reach the engine.
        vocab_size = FAIL_TOKEN + 1
        yield EngineHarness(client, tokenizer, "tiny", 256, fake.aborted.__contains__, vocab_size)


@pytest.fixture(scope="session")
def api_cluster(tiny_checkpoint, tmp_path_factory):
    from tests.cluster.helpers import launch_cluster

    folder = tmp_path_factory.mktemp("api-cluster")
    args = ("--tp", "1", "--max-model-len", str(CLUSTER_MAX_MODEL_LEN))
    with launch_cluster(folder, tiny_checkpoint("llama"), *args) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def stats_client(api_cluster):
    """A second client of the cluster, to read its stats."""
    from ipc.client import EngineClient

    with EngineClient(api_cluster.address) as client:
        yield client


@pytest.fixture(scope="module")
def cluster_engine(api_cluster, stats_client) -> EngineHarness:
    from ipc.client import AsyncEngineClient
    from ipc.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(api_cluster.model)
    client = AsyncEngineClient(api_cluster.address, tokenizer=tokenizer)

    def idle(_request_id: str) -> bool:
        stats = stats_client.stats()
        return stats.num_running == 0 and stats.num_waiting == 0

    # "abc": the tiny random model answers it in printable bytes.
    return EngineHarness(client, tokenizer, "llama", CLUSTER_MAX_MODEL_LEN, idle, text_prompt="abc")


@pytest.fixture(scope="module")
def text_prompt(engine: EngineHarness) -> str:
    return engine.text_prompt


@pytest.fixture(scope="module")
def live_server(engine: EngineHarness):
    app = build_app(
        engine.client,
        engine.tokenizer,
        engine.model_name,
        API_KEY,
        engine.max_model_len,
        vocab_size=engine.vocab_size,
    )
    server = LiveServer(app, engine.client)
    yield server
    server.stop()


@pytest.fixture
def oai(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def http(live_server: LiveServer):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=30) as client:
        yield client
