"""What the clients raise for a request the engine failed, and for an engine gone."""

from ipc.messages import EngineCoreOutput, ErrorCode


class RequestError(ValueError):
    """The EngineCore refused or failed a request (finish_reason "error"); `code` says
    whether the request was at fault (INVALID_REQUEST) or the engine (INTERNAL,
    UNAVAILABLE)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def from_output(cls, out: EngineCoreOutput) -> "RequestError":
        """The error of an output that finished with "error"."""
        return cls(out.error or "the EngineCore failed", out.error_code)


class EngineDeadError(RuntimeError):
    """The EngineCore did not answer in time, or the connection to it is lost."""
