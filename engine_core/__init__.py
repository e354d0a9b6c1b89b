"""The EngineCore: configuration, requests, the scheduler and the in-process engine loop."""

from engine_core.core import EngineCore
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler
from ipc.config import EngineConfig
from ipc.executor import Executor
from ipc.sampling_params import SamplingParams

__all__ = [
    "EngineConfig",
    "EngineCore",
    "Executor",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
]
