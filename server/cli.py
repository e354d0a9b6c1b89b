"""`run_server` and the `python -m server` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from ipc.auth import Credentials
from ipc.client import AsyncEngineClient, DataParallelClient
from ipc.defaults import generation_defaults
from ipc.tokenizer import Tokenizer
from server.app import build_app
from server.args import add_server_args, check_server_args, server_options

logger = logging.getLogger(__name__)


def run_server(
    engine_address: str,
    tokenizer_path: str,
    host: str = "0.0.0.0",
    port: int = 8000,
    served_model_name: str | None = None,
    credentials: Credentials | str | os.PathLike | None = None,
    chat_template: str | None = None,
    reuse_port: bool = False,
    **app_options: Any,
) -> None:
    """Serve the API until SIGINT/SIGTERM. `engine_address`: one engine's, or several
    data-parallel engines' separated by commas. The model name defaults to the tokenizer
    folder's name, the sampling defaults to its generation_config.json's; `credentials`
    (a file or Credentials) are needed on a tcp engine; `chat_template` replaces the
    tokenizer's; with `reuse_port` the port is shared with the other servers that bind
    it so (SO_REUSEPORT: the kernel spreads the connections); `app_options` are
    build_app's."""
    tokenizer = Tokenizer.from_pretrained(tokenizer_path, chat_template)
    if "," in engine_address:
        client = DataParallelClient(engine_address, tokenizer=tokenizer, credentials=credentials)
    else:
        client = AsyncEngineClient(engine_address, tokenizer=tokenizer, credentials=credentials)
    if app_options.get("sampling_defaults") is None:
        app_options["sampling_defaults"] = generation_defaults(tokenizer_path)
    name = served_model_name or Path(tokenizer_path).name
    app = build_app(client, tokenizer, name, **app_options)
    asyncio.run(_serve(app, client, host, port, reuse_port))


async def _serve(
    app: FastAPI,
    client: AsyncEngineClient | DataParallelClient,
    host: str,
    port: int,
    reuse_port: bool,
) -> None:
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
        sockets = [_shared_socket(host, port)] if reuse_port else None
        await uvicorn.Server(config).serve(sockets)
    finally:
        await client.close()


def _shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port) that other processes may bind too."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__)
    parser.add_argument(
        "--engine-address",
        required=True,
        help="the EngineCore's client socket (several data-parallel engines: comma-separated)",
    )
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face model folder")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + completion, in tokens")
    parser.add_argument(
        "--vocab-size", type=int, help="the model's; token ids must be below it (default: any)"
    )
    parser.add_argument("--credentials", help="client credentials of a tcp engine address")
    parser.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        help="the engine's: under fcfs a request's non-zero priority is a 400 (default: "
        "unknown, priorities are passed on)",
    )
    args = add_server_args(parser).parse_args(argv)
    check_server_args(parser, args)
    options = server_options(args)
    with contextlib.suppress(KeyboardInterrupt):
        run_server(
            args.engine_address,
            args.tokenizer,
            max_model_len=args.max_model_len,
            vocab_size=args.vocab_size,
            credentials=args.credentials,
            scheduling_policy=args.scheduling_policy,
            **options,
        )
