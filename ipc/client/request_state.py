"""One request the engine runs, as a client sees it: the engine's outputs folded into a
RequestOutput (incremental detokenization, stop strings, logprobs)."""

from __future__ import annotations

from typing import Protocol

from ipc.detokenizer import IncrementalDetokenizer
from ipc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from ipc.outputs import CompletionOutput, RequestOutput, logprobs_by_token
from ipc.tokenizer import TokenizerLike

_STOP_STRING_WINS = (None, FinishReason.STOP, FinishReason.LENGTH)


class Sink(Protocol):
    """Where a request's deltas go: a queue.SimpleQueue or an asyncio.Queue."""

    def put_nowait(self, item: RequestOutput | Exception) -> None: ...

    def get_nowait(self) -> RequestOutput | Exception: ...

    def empty(self) -> bool: ...


class RequestState:
    """One live request: its cumulative result and where its deltas go (`queue`; None
    for a child of a parallel request, whose deltas its ParentRequest folds, and for
    LLM's requests). `index`: the choice it is (a child's index among its siblings)."""

    def __init__(
        self,
        request: EngineCoreRequest,
        tokenizer: TokenizerLike | None,
        queue: Sink | None = None,
        prompt: str | None = None,
        index: int = 0,
    ) -> None:
        params = request.sampling_params
        self.request = request
        self.queue = queue
        self.index = index
        self.tokenizer = tokenizer
        self.detokenizer = (
            None
            if tokenizer is None
            else IncrementalDetokenizer(
                tokenizer,
                request.prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
        )
        self.stop_hold = max((len(s) for s in params.stop), default=1) - 1
        self.stopped_by_string = False
        self.include_stop = params.include_stop_str_in_output
        self.result = RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            [CompletionOutput(index, "", [])],
            prompt=prompt,
        )
        if params.prompt_logprobs is not None:
            self.result.prompt_logprobs = []

    def apply(self, out: EngineCoreOutput) -> RequestOutput:
        """Fold one engine output into `result` and return the delta (finish reasons as
        the API names them). The request finishes when the engine says so or when the
        text reaches a stop string: then `stopped_by_string` is set, and the engine,
        which goes on, must be told to abort it."""
        result, completion = self.result, self.result.outputs[0]
        completion.token_ids.extend(out.new_token_ids)
        logprobs = None
        if out.logprobs:
            logprobs = [logprobs_by_token(entry, self._decode) for entry in out.logprobs]
            completion.logprobs = (completion.logprobs or []) + logprobs
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
                entry.logprobs[0] for entry in out.logprobs
            )
        result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
        prompt_logprobs = self._add_prompt_logprobs(out)
        finish_reason = None if out.finish_reason is None else str(out.finish_reason)
        stop_reason = self._stop_token(out)
        text = ""
        if self.detokenizer is not None:
            new_token_ids = out.new_token_ids
            if out.finish_reason == FinishReason.STOP and not self.include_stop:
                new_token_ids = new_token_ids[:-1]  # the stop token (or EOS) is no text
            self.detokenizer.add_tokens(new_token_ids)
            if self.detokenizer.stopped and out.finish_reason in _STOP_STRING_WINS:
                # The text reached a stop string before whatever the engine stopped at.
                finish_reason, stop_reason = str(FinishReason.STOP), self.detokenizer.stop_reason
                self.stopped_by_string = out.finish_reason is None
            text = self._release_text(finished=finish_reason is not None)
            completion.text += text
        if finish_reason is not None:
            completion.finish_reason = finish_reason
            completion.stop_reason = stop_reason
            result.error = out.error
            result.request_stats = out.request_stats
            if out.kv_transfer_params is not None:
                result.kv_transfer_params = out.kv_transfer_params.to_dict()
            result.finished = True
        delta = CompletionOutput(
            self.index, text, list(out.new_token_ids), finish_reason, logprobs, stop_reason
        )
        return RequestOutput(
            result.request_id,
            result.prompt_token_ids,
            [delta],
            result.finished,
            result.num_cached_tokens,
            result.error,
            prompt_logprobs,
            result.prompt,
            out.request_stats,
            result.kv_transfer_params,
        )

    def abort(self) -> RequestOutput:
        """Finish with "abort"; the last delta."""
        return self.apply(EngineCoreOutput(self.request.request_id, [], FinishReason.ABORT))

    def _add_prompt_logprobs(self, out: EngineCoreOutput) -> list | None:
        """Append the output's prompt logprobs to the result's (None first); return them."""
        so_far = self.result.prompt_logprobs
        if so_far is None:
            return None
        entries = [logprobs_by_token(entry, self._decode) for entry in out.prompt_logprobs or ()]
        new = ([] if so_far else [None]) + entries
        so_far.extend(new)
        return new or None

    def _decode(self, token_id: int) -> str | None:
        """A logprob's token as text (vLLM's decoded_token)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _stop_token(self, out: EngineCoreOutput) -> int | None:
        """The stop token id that ended the request (None for EOS or no stop token)."""
        if out.finish_reason != FinishReason.STOP or not out.new_token_ids:
            return None
        last = out.new_token_ids[-1]
        return last if last in self.request.sampling_params.stop_token_ids else None

    def _release_text(self, finished: bool) -> str:
        """The detokenized text not given out yet, but for its last characters while a
        stop string could still begin there: text once given out is never taken back."""
        text, sent = self.detokenizer.text, len(self.result.outputs[0].text)
        end = len(text) if finished else max(len(text) - self.stop_hold, sent)
        return text[sent:end]
