"""splitserve: a multi-process LLM inference engine in the style of vLLM V1."""

from ipc.messages import SamplingParams
from ipc.outputs import CompletionOutput, RequestOutput
from splitserve.llm import LLM

__all__ = [
    "LLM",
    "AsyncEngineClient",
    "CompletionOutput",
    "EngineClient",
    "RequestOutput",
    "SamplingParams",
]

_CLIENTS = ("EngineClient", "AsyncEngineClient")


def __getattr__(name: str):
    """The clients of a running EngineCore, imported on first use."""
    if name in _CLIENTS:
        import ipc.client

        return getattr(ipc.client, name)
    raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
