"""Prefix-cache privacy: cache salts reach the engine, API keys can salt them per tenant,
and cached-token counts are reported only when asked for."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from server import add_server_args, build_app, server_child_args, server_options
from tests.server.fake_engine import FakeEngineClient
from tests.server.harness import asgi_client

CHAT = [{"role": "user", "content": "Hi"}]


async def salts_of(app, fake, calls: list[tuple[str | None, dict]]) -> list[str | None]:
    """The cache salt the engine got for each (api key, extra body) request."""
    salts = []
    for key, extra in calls:
        async with asgi_client(app, key) as client:
            body = {"prompt": "Hi", "max_tokens": 2, **extra}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
        salts.append(fake.salts[response.json()["id"]])
    return salts


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_cache_salt_reaches_the_engine(path):
    fake = FakeEngineClient()
    app = build_app(fake, fake.tokenizer, "fake-model")

    async def main() -> None:
        async with asgi_client(app) as client:
            body = {"max_tokens": 2, "cache_salt": "tenant-7"}
            body |= {"messages": CHAT} if "chat" in path else {"prompt": "Hi"}
            response = await client.post(path, json=body)
            assert response.status_code == 200
            assert fake.salts[response.json()["id"]] == "tenant-7"
            body.pop("cache_salt")
            response = await client.post(path, json=body)
            assert fake.salts[response.json()["id"]] is None

    asyncio.run(main())


def test_several_api_keys_are_accepted():
    fake = FakeEngineClient()
    app = build_app(fake, fake.tokenizer, "fake-model", ["k1", "k2"])

    async def status(key: str) -> int:
        async with asgi_client(app, key) as client:
            response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            return response.status_code

    assert [asyncio.run(status(k)) for k in ("k1", "k2", "k3", "k1,k2")] == [200, 200, 401, 401]


def test_salting_by_api_key_keeps_tenants_apart():
    fake = FakeEngineClient()
    app = build_app(fake, fake.tokenizer, "fake-model", ["k1", "k2"], salt_cache_by_api_key=True)
    calls = [
        ("k1", {}),
        ("k1", {}),
        ("k2", {}),
        ("k1", {"cache_salt": "s"}),
        ("k1", {"cache_salt": "s"}),
        ("k2", {"cache_salt": "s"}),
    ]
    k1, k1_again, k2, k1_salted, k1_salted_again, k2_salted = asyncio.run(
        salts_of(app, fake, calls)
    )
    assert k1 == k1_again and k1_salted == k1_salted_again  # a tenant still shares its cache
    salts = [k1, k2, k1_salted, k2_salted]
    assert len(set(salts)) == 4 and None not in salts and "s" not in salts
    assert all("k1" not in salt and "k2" not in salt for salt in salts)


def test_salting_by_api_key_needs_keys():
    fake = FakeEngineClient()
    with pytest.raises(ValueError, match="API keys"):
        build_app(fake, fake.tokenizer, "fake-model", salt_cache_by_api_key=True)


@pytest.mark.parametrize("enabled", [False, True])
def test_cached_tokens_are_reported_only_with_prompt_tokens_details(enabled):
    fake = FakeEngineClient()
    app = build_app(fake, fake.tokenizer, "fake-model", enable_prompt_tokens_details=enabled)

    async def usages() -> list[dict]:
        async with asgi_client(app) as client:
            body = {"messages": CHAT, "max_tokens": 2}
            whole = await client.post("/v1/chat/completions", json=body)
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            streamed = await client.post("/v1/chat/completions", json=body)
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
        return [whole.json()["usage"], json.loads(events[-1])["usage"]]

    for usage in asyncio.run(usages()):
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] == 2
        assert ("prompt_tokens_details" in usage) == enabled
        if enabled:
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def parse(argv: list[str]) -> argparse.Namespace:
    return add_server_args(argparse.ArgumentParser()).parse_args(argv)


def test_server_flags_and_their_defaults(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    assert server_options(parse([])) == {
        "host": "0.0.0.0",
        "port": 8000,
        "served_model_name": None,
        "api_keys": [],
        "salt_cache_by_api_key": False,
        "enable_prompt_tokens_details": False,
        "max_request_body_bytes": 8 * 1024 * 1024,
        "cors": None,
        "enable_auto_tool_choice": False,
        "tool_call_parser": None,
        "chat_template": None,
    }
    monkeypatch.setenv("SPLITSERVE_API_KEY", "a, b")
    assert server_options(parse([]))["api_keys"] == ["a", "b"]
    flags = server_options(parse(["--api-key", "c", "--api-key", "d"]))
    assert flags["api_keys"] == ["c", "d"]  # the flags win over the environment
    # vLLM's flag for what is always on here: accepted, changing nothing.
    assert server_options(parse(["--enable-request-id-headers"])) == server_options(parse([]))


def test_a_launcher_hands_the_server_flags_on_to_its_child(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    argv = ["--api-key", "k1", "--api-key", "k2", "--salt-cache-by-api-key", "--api-port", "9"]
    argv += ["--enable-prompt-tokens-details", "--max-request-body-bytes", "1000"]
    argv += ["--allowed-origins", '["https://a.example"]', "--allowed-methods", '["GET"]']
    argv += ["--allow-credentials"]
    parent = parse(argv + ["--served-model-name", "m"])
    child_argv, child_env = server_child_args(parent)
    assert not any("k1" in arg for arg in child_argv)  # keys stay out of `ps`
    monkeypatch.setenv("SPLITSERVE_API_KEY", child_env["SPLITSERVE_API_KEY"])
    assert server_options(parse(child_argv)) == server_options(parent)
    assert server_options(parent)["api_keys"] == ["k1", "k2"]
