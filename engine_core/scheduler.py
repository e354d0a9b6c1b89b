"""The scheduler: which requests run this step, for how many tokens, in which KV blocks.

There are no prefill and decode phases. Each request's num_computed_tokens chases its
num_tokens under a per-step token budget: running requests first (a decode needs one
token, a chunked prefill as many as the budget allows), then waiting ones. When the KV
cache is full, running requests are preempted: swapped out to the host tier and later
copied back, or freed and later recomputed, whichever costs less.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Sequence

from engine_core.request import Request, RequestStatus
from engine_core.request_checks import check_lengths, check_token_ids
from engine_core.request_queue import make_request_queue
from engine_core.structured_output import GRAMMAR_REJECTED, StructuredOutputManager
from ipc.config import EngineConfig, PreemptionMode, SchedulingPolicy
from ipc.messages import (
    ITERATION_TOKEN_BUCKETS,
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    ErrorCode,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from ipc.utils import cdiv
from kv_cache import KVCacheBlocks, KVCacheManager

_GRAMMAR_ERROR = {"error": GRAMMAR_REJECTED, "error_code": ErrorCode.INTERNAL}


class Scheduler:
    """`block_copy_seconds` (one KV block, one way between the tiers) and
    `prefill_token_seconds` are the workers' measured costs; preemption_mode auto compares
    them to choose between swap and recompute."""

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        block_copy_seconds: float = 0.0,
        prefill_token_seconds: float = 0.0,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.block_copy_seconds = block_copy_seconds
        self.prefill_token_seconds = prefill_token_seconds
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        if config.max_num_batched_tokens is None:
            raise ValueError(
                "the scheduler needs max_num_batched_tokens (EngineConfig.token_budget)"
            )
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_size = config.block_size
        blocks_per_request = _max_blocks_per_request(config, kv_cache_manager.group_windows)
        usable_blocks = kv_cache_manager.block_pool.num_blocks - 1
        if usable_blocks < blocks_per_request:
            raise ValueError(
                f"the KV cache holds {usable_blocks} blocks of {config.block_size} tokens, fewer "
                f"than one request of max_model_len={config.max_model_len} needs "
                f"({blocks_per_request}); lower max_model_len or give the KV cache more memory"
            )
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(config.scheduling_policy)
        self.running: list[Request] = []
        # Requests finished since the last step that was sent to the workers.
        self.finished_req_ids: list[str] = []
        # Outputs of requests that finished outside update_from_output (errors, aborts).
        self.pending_outputs: list[EngineCoreOutput] = []
        self.structured_output = StructuredOutputManager(config)
        self.step_id = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_cache_hits = 0

    @property
    def needs_lockstep(self) -> bool:
        """A structured-output request is live: its next bitmask needs the grammar to have
        seen every token before it, so no step may be scheduled ahead of an answer."""
        return bool(self.structured_output.matchers)

    def add_request(self, request: Request) -> None:
        """Queue a request, or finish it at once with FINISHED_ERROR if it can never run."""
        error = self._check_request(request)
        if error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            self.pending_outputs.append(
                EngineCoreOutput(request.request_id, [], FinishReason.ERROR, error=error)
            )
            return
        if self.kv_cache_manager.enable_caching:
            request.enable_block_hashing(self.block_size)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _check_request(self, request: Request) -> str | None:
        if request.request_id in self.requests:
            return f"request id {request.request_id!r} is already in use"
        error = check_lengths(request, self.max_model_len) or check_token_ids(
            request.prompt_token_ids, request.sampling_params, self.config
        )
        structured = request.sampling_params.structured_outputs
        if error is None and structured is not None:
            error = self.structured_output.add_request(request.request_id, structured)
        return error

    def schedule(self) -> SchedulerOutput:
        num_scheduled_tokens: dict[str, int] = {}
        running, new_block_ids, preempted = self._schedule_running(num_scheduled_tokens)
        new_reqs: list[NewRequestData] = []
        resumed: list[Request] = []
        if not preempted:
            new_reqs, resumed = self._schedule_waiting(num_scheduled_tokens)
        # A request preempted after being scheduled this step gave its tokens back.
        running = [r for r in running if r.request_id in num_scheduled_tokens]
        kv = self.kv_cache_manager
        cached_reqs = CachedRequestData(
            req_ids=[r.request_id for r in running] + [r.request_id for r in resumed],
            resumed_from_preemption=[False] * len(running) + [True] * len(resumed),
            new_token_ids=[[] for _ in running] + [list(r.all_token_ids) for r in resumed],
            new_block_ids=[new_block_ids[r.request_id] for r in running]
            + [kv.get_block_ids(r.request_id) for r in resumed],
            num_computed_tokens=[r.num_computed_tokens for r in running]
            + [r.num_computed_tokens for r in resumed],
        )
        structured_ids, bitmask = self.structured_output.grammar_bitmask(
            self.requests, num_scheduled_tokens
        )
        swap_out, swap_in = kv.take_block_copies()
        total = sum(num_scheduled_tokens.values())
        if total:
            self.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, total)] += 1
            self.iteration_tokens_sum += total
        scheduler_output = SchedulerOutput(
            self.step_id,
            new_reqs,
            cached_reqs,
            num_scheduled_tokens,
            total,
            self.finished_req_ids,
            structured_ids,
            bitmask,
            swap_out,
            swap_in,
        )
        self.step_id += 1
        # Finished ids reach the workers with the next step that runs; keep them until then.
        if num_scheduled_tokens or swap_out:
            self.finished_req_ids = []
        # Advance optimistically: the next schedule() sees these tokens as computed, and a
        # request computed to its end samples a token the next schedule() may already feed.
        requests = self.requests
        for request_id, num_new in num_scheduled_tokens.items():
            request = requests[request_id]
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        return scheduler_output

    def _schedule_running(
        self, num_scheduled_tokens: dict[str, int]
    ) -> tuple[list[Request], dict[str, list[int]], bool]:
        """Schedule running requests in order, preempting when the KV cache is full.
        Returns the scheduled requests, their blocks added this step, and whether any
        request was preempted."""
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        new_block_ids: dict[str, list[int]] = {}
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._has_all_its_tokens_in_flight(request):
                index += 1
                continue
            num_new = request.num_tokens + request.num_output_placeholders
            num_new = min(num_new - request.num_computed_tokens, budget)
            while (new_blocks := kv.allocate_slots(request, num_new)) is None:
                victim = self._select_victim()
                victim_index = self.running.index(victim)
                del self.running[victim_index]
                budget += num_scheduled_tokens.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted = True
                if victim_index < index:
                    index -= 1
                if victim is request:
                    break
            if new_blocks is None:
                continue
            num_scheduled_tokens[request.request_id] = num_new
            new_block_ids[request.request_id] = new_blocks.get_block_ids()
            scheduled.append(request)
            budget -= num_new
            index += 1
        return scheduled, new_block_ids, preempted

    def _has_all_its_tokens_in_flight(self, request: Request) -> bool:
        """Async scheduling: the steps in flight sample the request's last token (by
        max_tokens or max_model_len), so it must not run again."""
        num_placeholders = request.num_output_placeholders
        return num_placeholders > 0 and (
            request.num_output_tokens + num_placeholders == request.max_tokens
            or request.num_tokens + num_placeholders >= self.max_model_len
        )

    def _schedule_waiting(
        self, num_scheduled_tokens: dict[str, int]
    ) -> tuple[list[NewRequestData], list[Request]]:
        """Admit waiting requests in queue order after a prefix-cache lookup, until the
        budget, max_num_seqs or the KV cache runs out. Returns the new requests' data and
        the requests resumed from preemption."""
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens - sum(num_scheduled_tokens.values())
        new_reqs: list[NewRequestData] = []
        resumed: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if kv.is_swapped(request.request_id):
                hit_blocks, num_hit_tokens = kv.get_swapped_blocks(request)
            elif request.wants_prompt_logprobs:  # cached positions give no logits
                hit_blocks, num_hit_tokens = KVCacheBlocks.empty(kv.num_groups), 0
            else:
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            new_blocks = kv.allocate_slots(request, num_new, num_hit_tokens, hit_blocks)
            if new_blocks is None:
                break
            self.waiting.pop()
            self.running.append(request)
            request.num_computed_tokens = num_hit_tokens
            num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            if request.on_workers:
                resumed.append(request)
            else:
                if request.status == RequestStatus.WAITING:
                    request.num_cached_tokens = num_hit_tokens
                # Host-tier hits were copied into new device blocks: ask for the ids.
                block_ids = kv.get_block_ids(request.request_id)
                new_reqs.append(
                    NewRequestData(
                        request.request_id,
                        request.prompt_token_ids,
                        request.sampling_params,
                        block_ids,
                        num_hit_tokens,
                        list(request.output_token_ids),
                    )
                )
                request.on_workers = True
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
        return new_reqs, resumed

    def _select_victim(self) -> Request:
        if self.config.scheduling_policy == SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, allow_swap: bool = True) -> None:
        """Give back the request's device blocks and queue it at the front. Swapped out, its
        blocks wait in the host tier and are copied back when it resumes; otherwise they
        are freed and it is recomputed (from any prefix hits)."""
        kv = self.kv_cache_manager
        if not (allow_swap and self._swap_is_cheaper(request) and kv.swap_out(request)):
            kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _swap_is_cheaper(self, request: Request) -> bool:
        """preemption_mode auto: copying the blocks out and back costs less than prefilling
        the computed tokens again (by the workers' measured times)."""
        mode = self.config.preemption_mode
        kv = self.kv_cache_manager
        if mode == PreemptionMode.RECOMPUTE or not kv.has_host_tier:
            return False
        if request.num_computed_tokens == 0:
            return False
        if mode == PreemptionMode.SWAP:
            return True
        num_blocks = sum(1 for ids in kv.get_block_ids(request.request_id) for i in ids if i)
        swap = 2 * num_blocks * self.block_copy_seconds
        return swap < request.num_computed_tokens * self.prefill_token_seconds

    def requeue_for_new_workers(self) -> int:
        """The workers were replaced: they hold no KV and know no request. Preempt every
        running request (the latest admitted first, so the queue keeps their order),
        drop the prefix cache, whose blocks the new workers never computed, and send
        every request whole, with the tokens it generated, when it next runs. Returns the
        number of requests preempted."""
        kv = self.kv_cache_manager
        running, self.running = self.running, []
        for request in reversed(running):
            self._preempt(request, allow_swap=False)
        if kv.has_host_tier:  # the host tier's contents went with the old workers
            for request in self.waiting:
                if kv.is_swapped(request.request_id):
                    kv.free(request)
            kv.take_block_copies()
        if not kv.reset_prefix_cache():
            raise RuntimeError("KV blocks are still in use after every request was preempted")
        for request in self.requests.values():
            request.on_workers = False
            request.num_output_placeholders = 0  # the steps in flight died with the workers
        self.finished_req_ids = []
        return len(running)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append the sampled tokens, check stop conditions token by token, free the finished
        requests. Outputs go to requests that got a token or finished since the last call."""
        outputs = self.take_pending_outputs()
        requests = self.requests
        finished = False
        for request_id, error in model_runner_output.failed_requests.items():
            request = requests.get(request_id)
            if request is not None:
                finished = True
                self._free_request(request, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(request_id, [], FinishReason.ERROR, error=error))
        num_generated = 0
        grammars = self.structured_output.matchers
        logprobs = model_runner_output.logprobs  # None, or one entry per request
        prompt_logprobs = {
            request_id: requests[request_id].take_prompt_logprobs(chunk)
            for request_id, chunk in model_runner_output.prompt_logprobs.items()
            if request_id in requests
        }
        for i, (request_id, token_ids) in enumerate(
            zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True)
        ):
            request = requests.get(request_id)
            if request is None or not token_ids:
                continue
            request.num_output_placeholders -= 1
            if not request.output_token_ids:
                self.num_prompt_tokens += request.num_prompt_tokens
                request.first_token_time = time.monotonic()
            new_token_ids = []
            status = None
            for token_id in token_ids:
                request.append_output_token_id(token_id)
                new_token_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    break
            if status is None and request_id in grammars:
                status = self.structured_output.accept_tokens(request, new_token_ids)
            num_generated += len(new_token_ids)
            if status is not None:
                finished = True
                self._free_request(request, status)
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    new_token_ids,
                    None if status is None else status.finish_reason,
                    request.num_cached_tokens,
                    logprobs[i][: len(new_token_ids)] if logprobs and logprobs[i] else None,
                    prompt_logprobs=prompt_logprobs.pop(request_id, None) or None,
                    request_stats=None if status is None else request.stats(),
                    **_GRAMMAR_ERROR if status == RequestStatus.FINISHED_ERROR else {},
                )
            )
        for request_id, entries in prompt_logprobs.items():  # chunks that sampled nothing
            if entries:
                outputs.append(
                    EngineCoreOutput(
                        request_id,
                        [],
                        num_cached_tokens=requests[request_id].num_cached_tokens,
                        prompt_logprobs=entries,
                    )
                )
        self.num_generation_tokens += num_generated
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return EngineCoreOutputs(outputs)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        num_output = request.num_output_tokens
        # A stop token counts only once min_tokens tokens precede it (as in HF generate).
        if num_output > request.min_tokens and token_id in request.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if num_output == request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        """A preempted request can finish from the output of a step that was in flight when
        it was preempted (async scheduling): it leaves the waiting queue too."""
        if request.status == RequestStatus.PREEMPTED:
            self.waiting.remove_requests({request.request_id})
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)
        self.structured_output.free(request.request_id)

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish unfinished requests from outside (abort); unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        requests = [self.requests[i] for i in dict.fromkeys(request_ids) if i in self.requests]
        if not requests:
            return
        ids = {r.request_id for r in requests}
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting.remove_requests(ids)
        for request in requests:
            self._free_request(request, status)
            self.pending_outputs.append(
                EngineCoreOutput(request.request_id, [], status.finish_reason)
            )

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or a final output is not yet taken."""
        return bool(self.requests) or bool(self.pending_outputs)

    def get_stats(self) -> SchedulerStats:
        """Cumulative counters since start, and the current queue sizes and KV usage."""
        prefix_stats = self.kv_cache_manager.make_prefix_cache_stats()
        self.prefix_cache_queries += prefix_stats.queries
        self.prefix_cache_hits += prefix_stats.hits
        self.host_cache_hits += prefix_stats.host_hits
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_swapped_out_blocks=self.kv_cache_manager.num_swapped_out_blocks,
            num_swapped_in_blocks=self.kv_cache_manager.num_swapped_in_blocks,
            num_spilled_blocks=self.kv_cache_manager.num_spilled_blocks,
            host_cache_hits=self.host_cache_hits,
            iteration_tokens=list(self.iteration_tokens),
            iteration_tokens_sum=self.iteration_tokens_sum,
        )


def _max_blocks_per_request(config: EngineConfig, group_windows: Sequence[int | None]) -> int:
    """Blocks one request of max_model_len tokens may hold at once, over every KV cache
    group: all of its blocks in a full-attention group; in a window-W group the blocks a
    step's tokens and the W - 1 before them span."""
    full = cdiv(config.max_model_len, config.block_size)
    return sum(
        full
        if window is None
        else min(full, cdiv(window - 1 + config.max_num_batched_tokens, config.block_size) + 1)
        for window in group_windows
    )
