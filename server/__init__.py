"""OpenAI-compatible HTTP server over the EngineCore (FastAPI + uvicorn).

Names are loaded on first use, so `server.args` (the flags) comes without fastapi."""

from importlib import import_module
from typing import Any

_WHERE = {
    "build_app": "server.app",
    "run_server": "server.cli",
    "add_server_args": "server.args",
    "server_child_args": "server.args",
    "server_options": "server.args",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'server' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)
