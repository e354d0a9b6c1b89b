"""Prefill/decode disaggregation end to end: a producer and a consumer cluster (launch.py,
each with its HTTP server) behind `python -m splitserve.disagg_proxy`. Through the proxy,
completions (streamed or not) and chat answer as transformers' greedy generate does, and
the decode instance computes only the last token of each prompt
(request_prefill_kv_computed_tokens); a request whose KV cannot be pulled is recomputed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from ipc.sockets import free_tcp_port
from tests.cluster.helpers import ROOT, cluster_env, start_launch, wait_ready
from tests.integration.greedy import greedy_reference

MAX_TOKENS = 8
ARGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256")


def wait_http(url: str, process: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{url} did not come up:\n{log.read_text()}")
        time.sleep(0.2)


def stop(processes: list[tuple[subprocess.Popen, Path]]) -> list[int]:
    """SIGTERM every process, then their exit codes (killed after 30 s)."""
    for process, _ in processes:
        process.terminate()
    codes = []
    for process, _ in processes:
        try:
            codes.append(process.wait(30))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
    return codes


@pytest.fixture(scope="module")
def pd(tiny_checkpoint, tmp_path_factory):
    model = tiny_checkpoint()
    folder = tmp_path_factory.mktemp("pd")
    kv_port = free_tcp_port(count=1)
    # Short times: a transfer nobody pulls holds the producer's shutdown until it expires.
    extra = {"credentials": str(folder / "kv.credentials"), "pull_timeout_s": 3}
    extra["send_timeout_s"] = 5
    clusters: list[tuple[subprocess.Popen, Path]] = []
    proxy: list[tuple[subprocess.Popen, Path]] = []
    urls = {}
    try:
        for role in ("kv_producer", "kv_consumer"):
            (folder / role).mkdir()
            port = free_tcp_port(count=1)
            config = {"kv_role": role, "kv_port": kv_port, "kv_connector_extra_config": extra}
            process, log, address_file = start_launch(
                folder / role,
                *("--model", model, *ARGS, "--port", str(port)),
                *("--kv-transfer-config", json.dumps(config)),
            )
            clusters.append((process, log))
            wait_ready(process, log, address_file)
            urls[role] = f"http://127.0.0.1:{port}"
        for (process, log), url in zip(clusters, urls.values(), strict=True):
            wait_http(url, process, log)
        proxy_port = free_tcp_port(count=1)
        proxy_log = folder / "proxy.log"
        with proxy_log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "splitserve.disagg_proxy", "--port", str(proxy_port)]
                + ["--prefill", urls["kv_producer"], "--decode", urls["kv_consumer"]],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=cluster_env(),
                cwd=ROOT,
            )
        proxy.append((process, proxy_log))
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        wait_http(proxy_url, process, proxy_log)
        yield proxy_url, urls, model
    finally:
        stop(proxy)
        for code, (_, log) in zip(stop(clusters), clusters, strict=True):
            assert code == 0, log.read_text()


def histogram(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on an instance's /metrics ((0, 0) before its first
    sample)."""
    text = httpx.get(f"{url}/metrics").text
    found = [
        re.search(rf"^{name}_{part}{{[^}}]*}} (\S+)$", text, re.M) for part in ("sum", "count")
    ]
    return tuple(float(m.group(1)) if m else 0.0 for m in found)


def test_completions_through_the_proxy_equal_one_instance(pd):
    proxy_url, urls, model = pd
    greedy = greedy_reference(model)
    oai = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="none", max_retries=0)
    name = oai.models.list().data[0].id
    prompts = [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate((20, 45, 70))]
    metric = "splitserve:request_prefill_kv_computed_tokens"
    before = histogram(urls["kv_consumer"], metric)
    extra = {"ignore_eos": True, "return_token_ids": True}
    kwargs = dict(model=name, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra)
    for prompt in prompts[:2]:
        out = oai.completions.create(prompt=prompt, **kwargs)
        assert out.choices[0].model_extra["token_ids"] == greedy(prompt, MAX_TOKENS)
    chunks = oai.completions.create(prompt=prompts[2], stream=True, **kwargs)
    token_ids = [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"]]
    assert token_ids == greedy(prompts[2], MAX_TOKENS)
    after = histogram(urls["kv_consumer"], metric)
    assert after[1] - before[1] == 3
    assert after[0] - before[0] == 3  # one computed prompt token per request


def test_chat_through_the_proxy_equals_one_instance(pd):
    proxy_url, urls, model = pd
    messages = [{"role": "user", "content": "tell me about blocks"}]
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    direct = httpx.post(f"{urls['kv_consumer']}/v1/chat/completions", json=body, timeout=60)
    through = httpx.post(f"{proxy_url}/v1/chat/completions", json=body, timeout=60)
    assert through.status_code == direct.status_code == 200
    direct_choice, choice = direct.json()["choices"][0], through.json()["choices"][0]
    assert choice["message"]["content"] == direct_choice["message"]["content"]


def prefill(url: str, prompt: list[int]) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["kv_transfer_params"]


@pytest.mark.parametrize(
    ("seed", "forge"),
    [
        (5, lambda params: {**params, "remote_port": free_tcp_port(count=1)}),
        (6, lambda params: {**params, "transfer_key": "guessed"}),
    ],
    ids=["unreachable producer", "forged key"],
)
def test_params_that_cannot_be_pulled_cost_a_recompute(pd, seed, forge):
    _, urls, model = pd
    prompt = [(11 * j + seed) % 250 for j in range(40)]
    params = forge(prefill(urls["kv_producer"], prompt))
    metric = "splitserve:request_prefill_kv_computed_tokens"
    before = histogram(urls["kv_consumer"], metric)
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": params,
    }
    answer = httpx.post(f"{urls['kv_consumer']}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == greedy_reference(model)(prompt, MAX_TOKENS)
    after = histogram(urls["kv_consumer"], metric)
    assert after[0] - before[0] == len(prompt)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"do_remote_decode": True, "surprise": 1}, "unknown field `surprise`"),
        ({"do_remote_prefill": True}, "do_remote_prefill needs"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "exclude each other"),
    ],
)
def test_bad_params_are_a_400_naming_the_field(pd, params, message):
    _, urls, _ = pd
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": params}
    answer = httpx.post(f"{urls['kv_consumer']}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "kv_transfer_params" and message in error["message"]


def test_a_role_the_instance_lacks_is_a_400(pd):
    _, urls, _ = pd
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(f"{urls['kv_consumer']}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400
    assert "needs a KV producer" in answer.json()["error"]["message"]
