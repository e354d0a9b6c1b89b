"""splitserve: a multi-process LLM inference engine in the style of vLLM V1."""

from importlib import import_module

from ipc.outputs import CompletionOutput, Logprob, RequestOutput
from ipc.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngineClient",
    "CompletionOutput",
    "EngineClient",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]

# Imported on first use, so that a worker process (launch.py --role worker imports
# splitserve's modules) loads neither the EngineCore nor the clients.
_WHERE = {
    "LLM": "splitserve.llm",
    "EngineClient": "ipc.client",
    "AsyncEngineClient": "ipc.client",
    "TextPrompt": "ipc.client.input_processor",
    "TokensPrompt": "ipc.client.input_processor",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
