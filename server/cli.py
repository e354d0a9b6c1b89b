"""`run_server` and the `python -m server` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from ipc.client import AsyncEngineClient
from ipc.defaults import generation_defaults
from ipc.tokenizer import Tokenizer
from server.app import build_app
from server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES

logger = logging.getLogger(__name__)
API_KEY_ENV = "SPLITSERVE_API_KEY"


def run_server(
    engine_address: str,
    tokenizer_path: str,
    host: str = "0.0.0.0",
    port: int = 8000,
    served_model_name: str | None = None,
    api_keys: str | Sequence[str] | None = None,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
    salt_cache_by_api_key: bool = False,
    enable_prompt_tokens_details: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> None:
    """Serve the API until SIGINT/SIGTERM. The model name defaults to the tokenizer
    folder's name; the other settings are build_app's."""
    tokenizer = Tokenizer.from_pretrained(tokenizer_path)
    client = AsyncEngineClient(engine_address, tokenizer=tokenizer)
    name = served_model_name or Path(tokenizer_path).name
    app = build_app(
        client,
        tokenizer,
        name,
        api_keys=api_keys,
        max_model_len=max_model_len,
        sampling_defaults=generation_defaults(tokenizer_path),
        vocab_size=vocab_size,
        salt_cache_by_api_key=salt_cache_by_api_key,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        max_request_body_bytes=max_request_body_bytes,
    )
    asyncio.run(_serve(app, client, host, port))


async def _serve(app: FastAPI, client: AsyncEngineClient, host: str, port: int) -> None:
    """Connect first (the port opens once the engine answers), then serve."""
    while True:
        try:
            await client.connect()
            break
        except TimeoutError as e:
            logger.warning("%s; still trying", e)
    try:
        # On SIGINT/SIGTERM, streams still open after 5 s are cut (which aborts them).
        config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5)
        await uvicorn.Server(config).serve()
    finally:
        await client.close()


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The HTTP server's flags (launch.py shares them)."""
    group = parser.add_argument_group("OpenAI-compatible API server")
    group.add_argument("--api-host", default="0.0.0.0", help="default: %(default)s")
    group.add_argument("--api-port", type=int, default=8000, help="default: %(default)s")
    group.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1; repeat it for several keys "
        f"(default: ${API_KEY_ENV}, comma-separated)",
    )
    group.add_argument("--served-model-name", help="default: the model folder's name")
    group.add_argument(
        "--salt-cache-by-api-key",
        action="store_true",
        help="salt each request's prefix-cache blocks with its API key, so that requests "
        "made with different keys never share cached prompts",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details (the cached prompt tokens); off by default, "
        "as in vLLM",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="refuse larger request bodies with a 413 (default: %(default)s, 8 MiB)",
    )
    return parser


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """run_server's keyword arguments from the flags add_server_args declares; a flag the
    namespace lacks takes its default."""
    defaults = add_server_args(argparse.ArgumentParser()).parse_args([])
    given = {**vars(defaults), **vars(args)}
    return {
        "host": given["api_host"],
        "port": given["api_port"],
        "served_model_name": given["served_model_name"],
        "api_keys": _api_keys(given["api_key"]),
        "salt_cache_by_api_key": given["salt_cache_by_api_key"],
        "enable_prompt_tokens_details": given["enable_prompt_tokens_details"],
        "max_request_body_bytes": given["max_request_body_bytes"],
    }


def server_child_args(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """For a launcher that starts the server as a child process: the server flags of
    `args` as command-line arguments, and the environment variable that carries the API
    keys (out of sight of `ps`)."""
    options = server_options(args)
    argv = ["--api-host", options["host"], "--api-port", str(options["port"])]
    if options["served_model_name"]:
        argv += ["--served-model-name", options["served_model_name"]]
    for flag in ("salt_cache_by_api_key", "enable_prompt_tokens_details"):
        if options[flag]:
            argv.append("--" + flag.replace("_", "-"))
    argv += ["--max-request-body-bytes", str(options["max_request_body_bytes"])]
    return argv, {API_KEY_ENV: ",".join(options["api_keys"])}


def _api_keys(given: str | list[str] | None) -> list[str]:
    """The keys given, or else those in $SPLITSERVE_API_KEY; each may be a comma-separated
    list."""
    if given is None:
        given = os.environ.get(API_KEY_ENV, "")
    values = [given] if isinstance(given, str) else given
    return [key.strip() for value in values for key in value.split(",") if key.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__)
    parser.add_argument("--engine-address", required=True, help="the EngineCore's client socket")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face model folder")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + completion, in tokens")
    parser.add_argument(
        "--vocab-size", type=int, help="the model's; token ids must be below it (default: any)"
    )
    args = add_server_args(parser).parse_args(argv)
    options = server_options(args)
    if options["salt_cache_by_api_key"] and not options["api_keys"]:
        parser.error("--salt-cache-by-api-key needs --api-key")
    with contextlib.suppress(KeyboardInterrupt):
        run_server(
            args.engine_address,
            args.tokenizer,
            max_model_len=args.max_model_len,
            vocab_size=args.vocab_size,
            **options,
        )
