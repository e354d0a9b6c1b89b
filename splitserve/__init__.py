"""splitserve: a multi-process LLM inference engine in the style of vLLM V1."""

from ipc.messages import SamplingParams
from ipc.outputs import CompletionOutput, RequestOutput
from splitserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
