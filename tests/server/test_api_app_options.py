"""What only a scripted engine or an app of its own can show: the engine's scheduling
policy against `priority`, CORS, and the stop reason of EOS."""

from __future__ import annotations

import argparse
import asyncio

from server import build_app
from server.args import add_server_args, server_options
from tests.server.fake_engine import FakeEngineClient
from tests.server.harness import asgi_client

BODY = {"prompt": "Hi", "max_tokens": 2}


def post_all(app, *requests: tuple[str, str, dict, dict]) -> list:
    """(method, path, json, headers) requests to `app`, answered in order."""

    async def run() -> list:
        async with asgi_client(app) as client:
            return [
                await client.request(method, path, json=body, headers=headers)
                for method, path, body, headers in requests
            ]

    return asyncio.run(run())


def fake_app(**options):
    engine = FakeEngineClient()
    return engine, build_app(engine, engine.tokenizer, "m", **options)


def test_priority_is_refused_under_fcfs_and_passed_on_otherwise():
    _, fcfs = fake_app(scheduling_policy="fcfs")
    refused, zero = post_all(
        fcfs,
        ("POST", "/v1/completions", {**BODY, "priority": 1}, {}),
        ("POST", "/v1/completions", {**BODY, "priority": 0}, {}),
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in refused.json()["error"]["message"]
    assert zero.status_code == 200
    engine, app = fake_app(scheduling_policy="priority")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": -5}
    (response,) = post_all(app, ("POST", "/v1/chat/completions", body, {}))
    assert response.status_code == 200
    assert engine.priorities[response.json()["id"]] == -5


def cors_flags(*argv: str) -> dict | None:
    return server_options(add_server_args(argparse.ArgumentParser()).parse_args(argv))["cors"]


def test_cors_follows_the_allowed_origins():
    cors = cors_flags("--allowed-origins", '["https://ui.example"]', "--allow-credentials")
    assert cors == {
        "allow_origins": ["https://ui.example"],
        "allow_methods": ["*"],
        "allow_headers": ["*"],
        "allow_credentials": True,
    }
    _, app = fake_app(cors=cors, api_keys="k")
    preflight = {
        "Origin": "https://ui.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    allowed, other, post = post_all(
        app,
        ("OPTIONS", "/v1/completions", None, preflight),
        ("OPTIONS", "/v1/completions", None, {**preflight, "Origin": "https://evil.example"}),
        (
            "POST",
            "/v1/completions",
            BODY,
            {"Origin": "https://ui.example", "Authorization": "Bearer k"},
        ),
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert "access-control-allow-origin" not in other.headers
    assert post.headers["access-control-allow-origin"] == "https://ui.example"


def test_no_cors_headers_without_allowed_origins():
    assert cors_flags() is None
    _, app = fake_app()
    (response,) = post_all(app, ("POST", "/v1/completions", BODY, {"Origin": "https://x.example"}))
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_eos_has_no_stop_reason_and_the_flag_reaches_the_engine():
    engine, app = fake_app()
    body = {"prompt": "Hi", "max_tokens": 500, "include_stop_str_in_output": True}
    (response,) = post_all(app, ("POST", "/v1/completions", body, {}))
    choice = response.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    _, params = engine.requests[response.json()["id"]]
    assert params.include_stop_str_in_output


def test_a_long_request_id_header_is_replaced():
    _, app = fake_app()
    (response,) = post_all(app, ("POST", "/v1/completions", BODY, {"X-Request-Id": "x" * 300}))
    made = response.headers["x-request-id"]
    assert len(made) == 32 and response.json()["id"] == f"cmpl-{made}"
