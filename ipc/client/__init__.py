"""The client library of an EngineCore process: EngineClient (blocking, thread-safe)
and AsyncEngineClient (asyncio); DataParallelClient (asyncio), of several EngineCores.
`python -m ipc.client --help` streams one answer."""

from ipc.auth import Credentials, CredentialsError
from ipc.client.async_client import AsyncEngineClient
from ipc.client.dp_client import DataParallelClient
from ipc.client.errors import EngineDeadError, RequestError
from ipc.client.sync_client import EngineClient

__all__ = [
    "AsyncEngineClient",
    "Credentials",
    "CredentialsError",
    "DataParallelClient",
    "EngineClient",
    "EngineDeadError",
    "RequestError",
]
