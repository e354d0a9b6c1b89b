"""The engine's outputs as the clients and LLM give them back: each live request's
RequestOutput deltas (detokenized, cut at stop strings), a parallel request's children
folded into their parent, and the requests the engine must be told to abort.

Not thread-safe: the clients call it under their lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.client.errors import RequestError
from ipc.client.parallel_sampling import ParentRequest, child_requests, is_parallel
from ipc.client.request_state import RequestState, Sink
from ipc.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from ipc.outputs import RequestOutput
from ipc.tokenizer import TokenizerLike

# A live request as its consumer knows it.
Handle = RequestState | ParentRequest


def engine_states(handle: Handle) -> list[RequestState]:
    """The states of the requests the engine runs for `handle`."""
    return handle.children if isinstance(handle, ParentRequest) else [handle]


@dataclass
class ProcessedOutputs:
    # The requests without a queue that finished, as their whole results (vLLM's offline
    # FINAL_ONLY: their deltas are folded into the results and not kept, so that a step's
    # worth of them never outlives a garbage collection).
    finished: list[RequestOutput] = field(default_factory=list)
    # Engine request ids to abort: those that reached a stop string (the engine goes
    # on), and the live siblings of a child the engine failed.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: TokenizerLike | None) -> None:
        self.tokenizer = tokenizer
        # Live requests by their consumer's id.
        self.requests: dict[str, Handle] = {}
        # The states of the live requests the engine runs, by its ids (children too).
        self.request_states: dict[str, RequestState] = {}
        # A live child's parent, by the child's id.
        self.parent_of: dict[str, ParentRequest] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(
        self, request: EngineCoreRequest, prompt: str | None = None, queue: Sink | None = None
    ) -> Handle:
        """Track a request (fanned out into its children when it has n or best_of > 1):
        its deltas go to `queue`, or without one into process_outputs' answer. The engine
        is to run the requests of engine_states(handle)."""
        handle: Handle
        if is_parallel(request.sampling_params):
            children = [
                RequestState(child, self.tokenizer, index=index)
                for index, child in enumerate(child_requests(request))
            ]
            handle = ParentRequest(request, children, queue, prompt)
        else:
            handle = RequestState(request, self.tokenizer, queue, prompt)
        states = engine_states(handle)
        for request_id in {request.request_id, *(s.request.request_id for s in states)}:
            if request_id in self.requests or request_id in self.request_states:
                raise ValueError(f"request id {request_id!r} is already running")
        self.requests[request.request_id] = handle
        for state in states:
            self.request_states[state.request.request_id] = state
            if state is not handle:
                self.parent_of[state.request.request_id] = handle
        return handle

    def pop(self, request_id: str) -> Handle | None:
        """Forget a live request, with its children (None if it is not live; a child goes
        only with its parent)."""
        handle = self.requests.pop(request_id, None)
        if handle is not None:
            for state in engine_states(handle):
                self.request_states.pop(state.request.request_id, None)
                self.parent_of.pop(state.request.request_id, None)
        return handle

    def abort(self, request_id: str) -> list[str]:
        """Finish a live request with finish_reason "abort", waking its consumer; return
        the engine request ids to abort (none when it is not live)."""
        handle = self.pop(request_id)
        if handle is None:
            return []
        delta = handle.abort()
        if handle.queue is not None:
            handle.queue.put_nowait(delta)
        return [state.request.request_id for state in engine_states(handle)]

    def process_outputs(self, outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Fold the engine's outputs into their requests and deliver the deltas. A
        failed request's queue gets a RequestError instead (without a queue, the deltas
        carry the error); one failed child fails its parent."""
        processed = ProcessedOutputs()
        for out in outputs.outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # finished or aborted here; the engine has not caught up yet
            delta = state.apply(out)
            finished = delta.finished  # this engine request (a child, maybe) is done
            handle: Handle = state
            parent = self.parent_of.get(out.request_id)
            if parent is not None:
                handle, delta = parent, parent.fold(delta)
            if finished:
                del self.request_states[out.request_id]
                if parent is not None:
                    del self.parent_of[out.request_id]
                if out.finish_reason == FinishReason.ERROR:
                    self._fail(handle, delta, RequestError.from_output(out), processed)
                    continue
                if state.stopped_by_string:
                    processed.reqs_to_abort.append(out.request_id)
                if delta.finished:
                    del self.requests[handle.request.request_id]
            if handle.queue is None:
                if delta.finished:
                    processed.finished.append(handle.result)
            else:
                handle.queue.put_nowait(delta)
        return processed

    def _fail(
        self, handle: Handle, delta: RequestOutput, error: RequestError, processed: ProcessedOutputs
    ) -> None:
        """The engine failed `handle`'s request, or a child of it, whose live siblings then
        finish with "abort", here and in the engine."""
        self.pop(handle.request.request_id)
        if isinstance(handle, ParentRequest) and not delta.finished:
            processed.reqs_to_abort += handle.live_request_ids()
            handle.abort()
        if handle.queue is None:
            processed.finished.append(handle.result)
        else:
            handle.queue.put_nowait(error)

    def fail_all(self, error: Exception, drop_unread: bool = False) -> list[str]:
        """Fail every live request with `error`; return the engine request ids that were
        live. With `drop_unread`, deltas still queued for a request go before the error."""
        live = list(self.request_states)
        for queue in (h.queue for h in self.requests.values() if h.queue is not None):
            while drop_unread and not queue.empty():
                queue.get_nowait()
            queue.put_nowait(error)
        self.requests, self.request_states, self.parent_of = {}, {}, {}
        return live
