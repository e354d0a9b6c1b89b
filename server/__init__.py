"""OpenAI-compatible HTTP server over the EngineCore (FastAPI + uvicorn)."""

from server.app import build_app
from server.cli import add_server_args, run_server, server_child_args, server_options

__all__ = ["add_server_args", "build_app", "run_server", "server_child_args", "server_options"]
