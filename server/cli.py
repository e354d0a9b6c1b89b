"""`run_server` and the `python -m server` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from ipc.auth import Credentials
from ipc.client import AsyncEngineClient
from ipc.defaults import generation_defaults
from ipc.tokenizer import Tokenizer
from server.app import build_app

logger = logging.getLogger(__name__)


def run_server(
    engine_address: str,
    tokenizer_path: str,
    host: str = "0.0.0.0",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_model_len: int | None = None,
    credentials: Credentials | str | os.PathLike | None = None,
) -> None:
    """Serve the API until SIGINT/SIGTERM. The model name defaults to the tokenizer
    folder's name; `credentials` (a file or Credentials) are needed on a tcp engine."""
    tokenizer = Tokenizer.from_pretrained(tokenizer_path)
    client = AsyncEngineClient(engine_address, tokenizer=tokenizer, credentials=credentials)
    name = served_model_name or Path(tokenizer_path).name
    app = build_app(
        client,
        tokenizer,
        name,
        api_key=api_key,
        max_model_len=max_model_len,
        sampling_defaults=generation_defaults(tokenizer_path),
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
    group.add_argument("--api-host", default="0.0.0.0")
    group.add_argument("--api-port", type=int, default=8000)
    group.add_argument(
        "--api-key",
        default=os.environ.get("SPLITSERVE_API_KEY"),
        help="require 'Authorization: Bearer <key>' on /v1 (default: $SPLITSERVE_API_KEY)",
    )
    group.add_argument("--served-model-name", help="default: the model folder's name")
    group.add_argument("--max-model-len", type=int, help="longest prompt + completion, in tokens")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__)
    parser.add_argument("--engine-address", required=True, help="the EngineCore's client socket")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face model folder")
    parser.add_argument("--credentials", help="client credentials of a tcp engine address")
    args = add_server_args(parser).parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        run_server(
            args.engine_address,
            args.tokenizer,
            args.api_host,
            args.api_port,
            args.served_model_name,
            args.api_key,
            args.max_model_len,
            args.credentials,
        )
