"""The scheduler: which requests run this step, for how many tokens, in which KV blocks.

There are no prefill and decode phases. Each request's num_computed_tokens chases its
num_tokens under a per-step token budget: running requests first (a decode needs one
token, a chunked prefill as many as the budget allows), then waiting ones. When the KV
cache is full, running requests are preempted: swapped out to the host tier and later
copied back, or freed and later recomputed, whichever costs less.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine_core.kv_connector import make_kv_connector
from engine_core.preemption import PreemptionPolicy
from engine_core.remote_kv import RemoteKV, kv_transfer_error
from engine_core.request import Request, RequestStatus
from engine_core.request_checks import check_kv_cache_size, check_lengths, check_token_ids
from engine_core.request_queue import make_request_queue
from engine_core.scheduler_stats import SchedulerCounters, cache_config_info
from engine_core.spec_decode import SpecDecoding
from engine_core.step_update import update_requests
from engine_core.structured_output import StructuredOutputManager
from ipc.config import EngineConfig
from ipc.kv_transfer import KVTransferParams
from ipc.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from kv_cache import KVCacheBlocks, KVCacheManager


class Scheduler:
    """`block_copy_seconds` and `prefill_token_seconds` are the workers' measured costs
    (PreemptionPolicy)."""

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        block_copy_seconds: float = 0.0,
        prefill_token_seconds: float = 0.0,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.preemption = PreemptionPolicy(config, block_copy_seconds, prefill_token_seconds)
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        if config.max_num_batched_tokens is None:
            raise ValueError(
                "the scheduler needs max_num_batched_tokens (EngineConfig.token_budget)"
            )
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_size = config.block_size
        check_kv_cache_size(
            config, kv_cache_manager.group_windows, kv_cache_manager.block_pool.num_blocks
        )
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(config.scheduling_policy)
        self.running: list[Request] = []
        # Requests finished since the last step that was sent to the workers.
        self.finished_req_ids: list[str] = []
        # Outputs of requests that finished outside update_from_output (errors, aborts).
        self.pending_outputs: list[EngineCoreOutput] = []
        self.structured_output = StructuredOutputManager(config)
        spec = config.speculative_config
        self.spec = None if spec is None else SpecDecoding(spec, config.max_model_len)
        self._lookahead = 0 if self.spec is None else self.spec.num_lookahead_tokens
        self.step_id = 0
        self.counters = SchedulerCounters(cache_config_info(config, kv_cache_manager))
        connector = make_kv_connector(config)  # prefill/decode disaggregation
        self.remote_kv = None if connector is None else RemoteKV(connector, kv_cache_manager)

    @property
    def needs_lockstep(self) -> bool:
        """No step may be scheduled ahead of an answer while a structured-output request
        is live (its next bitmask needs the grammar to have seen every token before it) or
        the next step speculates (drafts follow a request's last known token, and a step's
        answer says how far each request got)."""
        return bool(self.structured_output.matchers) or self._speculates()

    def _speculates(self) -> bool:
        return self.spec is not None and self.spec.gate.speculates(len(self.running))

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
        request_id = request.request_id
        if request_id in self.requests or (self.remote_kv and self.remote_kv.owns(request_id)):
            return f"request id {request_id!r} is already in use"
        error = (
            check_lengths(request, self.max_model_len)
            or check_token_ids(request.prompt_token_ids, request.sampling_params, self.config)
            or kv_transfer_error(request, self.remote_kv)
        )
        structured = request.sampling_params.structured_outputs
        if error is None and structured is not None:
            error = self.structured_output.add_request(request.request_id, structured)
        return error

    def schedule(self) -> SchedulerOutput:
        num_scheduled_tokens: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        speculates = self._speculates()
        running, new_block_ids, preempted = self._schedule_running(
            num_scheduled_tokens, spec_tokens if speculates else None
        )
        new_reqs: list[NewRequestData] = []
        resumed: list[Request] = []
        if not preempted:
            new_reqs, resumed = self._schedule_waiting(num_scheduled_tokens)
        # A request preempted after being scheduled this step gave its tokens back.
        running = [r for r in running if r.request_id in num_scheduled_tokens]
        for request_id in [r for r in spec_tokens if r not in num_scheduled_tokens]:
            del spec_tokens[request_id]
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
            self.requests, num_scheduled_tokens, spec_tokens
        )
        swap_out, swap_in = kv.take_block_copies()
        total = sum(num_scheduled_tokens.values())
        self.counters.count_step(total)
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
            scheduled_spec_decode_tokens=spec_tokens,
        )
        if self.remote_kv is not None:
            scheduler_output.kv_connector_metadata = self.remote_kv.build_connector_meta()
        if self.spec is not None and total:
            gate = self.spec.gate
            mostly_prefill = gate.adaptive and _mostly_prefill(num_scheduled_tokens, spec_tokens)
            gate.step_scheduled(self.step_id, len(self.running), speculates, mostly_prefill)
            # A draft model drafts now for the next step, if the gate lets that one speculate.
            scheduler_output.propose_drafts = bool(self._lookahead) and self._speculates()
        self.step_id += 1
        # Finished ids reach the workers with the next step that runs; keep them until then.
        if num_scheduled_tokens or swap_out or scheduler_output.kv_connector_metadata:
            self.finished_req_ids = []
        # Advance optimistically: the next schedule() sees these tokens as computed, and a
        # request computed to its end samples a token the next schedule() may already feed.
        requests = self.requests
        for request_id, num_new in num_scheduled_tokens.items():
            request = requests[request_id]
            request.num_computed_tokens += num_new
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # drafts included
        return scheduler_output

    def _schedule_running(
        self, num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]] | None
    ) -> tuple[list[Request], dict[str, list[int]], bool]:
        """Schedule running requests in order, preempting when the KV cache is full; with
        `spec_tokens`, a request that decodes its last known token also verifies drafts
        (dropped first when the KV cache has no room for them). Returns the scheduled
        requests, their blocks added this step, and whether any request was preempted."""
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
            if num_new <= 0:  # drafts in flight: where it goes on is not known yet
                index += 1
                continue
            new_blocks = None
            if spec_tokens is not None and self._may_speculate(request, num_new):
                drafts = self.spec.drafts(request, budget)
                if drafts and request.request_id in self.structured_output.matchers:
                    num_valid = self.structured_output.num_valid_drafts(request.request_id, drafts)
                    drafts = drafts[:num_valid]
                if drafts:
                    lookahead = self._lookahead_slots(request.num_computed_tokens + 1 + len(drafts))
                    new_blocks = kv.allocate_slots(
                        request, 1 + len(drafts), num_lookahead_tokens=lookahead
                    )
                    if new_blocks is not None:
                        num_new = 1 + len(drafts)
                        spec_tokens[request.request_id] = drafts
            lookahead = self._lookahead_slots(request.num_computed_tokens + num_new)
            while new_blocks is None:
                new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
                if new_blocks is not None:
                    break
                if self.remote_kv is not None and self.remote_kv.ready:
                    self.waiting.prepend(self.remote_kv.release_ready())
                    continue
                victim = self.preemption.victim(self.running)
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

    def _lookahead_slots(self, num_tokens: int) -> int:
        """Slots after a request's first `num_tokens` for the draft model's tokens."""
        if not self._lookahead:
            return 0
        return max(0, min(self._lookahead, self.max_model_len - num_tokens))

    def _may_speculate(self, request: Request, num_new: int) -> bool:
        """Decoding its last known token, with no step in flight for it."""
        return num_new == 1 and request.num_output_placeholders == 0

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
        budget, max_num_seqs or the KV cache runs out; requests whose pulled KV landed (in
        blocks they hold) come first, and one that does not fit gives its blocks back and
        joins the queue. Returns the new requests' data and the requests resumed from
        preemption."""
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens - sum(num_scheduled_tokens.values())
        new_reqs: list[NewRequestData] = []
        resumed: list[Request] = []
        ready = [] if self.remote_kv is None else self.remote_kv.ready
        while (ready or self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = ready[0] if ready else self.waiting.peek()
            num_computed = request.num_computed_tokens  # > 0 only for a ready one
            if num_computed:
                hit_blocks, num_hit_tokens = None, 0
            elif kv.is_swapped(request.request_id):
                hit_blocks, num_hit_tokens = kv.get_swapped_blocks(request)
            elif request.wants_prompt_logprobs:  # cached positions give no logits
                hit_blocks, num_hit_tokens = KVCacheBlocks.empty(kv.num_groups), 0
            else:
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            if self.remote_kv is not None and not num_computed:
                loads = self.remote_kv.start_load(request, hit_blocks, num_hit_tokens)
                if loads is not None:
                    if not loads:
                        break
                    self.waiting.pop()  # until its KV lands
                    continue
            num_hit_tokens += num_computed
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            lookahead = self._lookahead_slots(num_hit_tokens + num_new)
            new_blocks = kv.allocate_slots(
                request, num_new, num_hit_tokens - num_computed, hit_blocks, lookahead
            )
            if new_blocks is None and num_computed:
                self.waiting.prepend(self.remote_kv.release_ready())
                continue
            if new_blocks is None:
                break
            if num_computed:
                ready.popleft()
            else:
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

    def _preempt(self, request: Request, allow_swap: bool = True) -> None:
        """Give back the request's device blocks and queue it at the front. Swapped out, its
        blocks wait in the host tier and are copied back when it resumes; otherwise they
        are freed and it is recomputed (from any prefix hits)."""
        kv = self.kv_cache_manager
        if not (allow_swap and self.preemption.swaps(request, kv) and kv.swap_out(request)):
            kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.prepend(request)

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
        if self.remote_kv is not None:  # the transfers died with the workers
            for request in self.remote_kv.reset():
                self.waiting.prepend(request)
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
        if self.spec is not None:
            self.spec.gate.forget_steps()
        return len(running)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append the sampled tokens, check stop conditions token by token, free the finished
        requests. Outputs go to requests that got a token or finished since the last call."""
        outputs = self.take_pending_outputs()
        requests = self.requests
        if model_runner_output.kv_connector_output is not None and self.remote_kv is not None:
            for request in self.remote_kv.update(model_runner_output.kv_connector_output):
                self.waiting.prepend(request)  # its pull failed
        finished = False
        for request_id, error in model_runner_output.failed_requests.items():
            request = requests.get(request_id)
            if request is not None:
                finished = True
                self._free_request(request, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(request_id, [], FinishReason.ERROR, error=error))
        if self.spec is not None:
            self.spec.step_answered(scheduler_output, model_runner_output, requests)
        updated, stopped = update_requests(
            model_runner_output, requests, self.max_model_len, self.structured_output, self.counters
        )
        outputs += updated
        for request, status in stopped:
            kv_transfer_params = self._free_request(request, status)
            if kv_transfer_params is not None:  # onto the request's last output
                output = next(o for o in reversed(updated) if o.request_id == request.request_id)
                output.kv_transfer_params = kv_transfer_params
        if finished or stopped:
            self.running = [r for r in self.running if not r.is_finished]
        return EngineCoreOutputs(outputs)

    def _free_request(self, request: Request, status: RequestStatus) -> KVTransferParams | None:
        """A preempted request can finish from the output of a step that was in flight when
        it was preempted (async scheduling): it leaves the waiting queue too. One whose KV
        is being pulled keeps its blocks until the pull ends; a KV producer's keeps them
        for a consumer: then the kv_transfer_params for its answer are returned."""
        if request.status == RequestStatus.PREEMPTED:
            self.waiting.remove_requests({request.request_id})
        was_loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        request.status = status
        kv_transfer_params = None
        if self.remote_kv is not None:
            kv_transfer_params = self.remote_kv.finish(request, was_loading)
        else:
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)
        self.structured_output.free(request.request_id)
        if self.spec is not None:
            self.spec.free(request.request_id)
        return kv_transfer_params

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
        remote = self.remote_kv is not None and self.remote_kv.has_requests
        return bool(self.requests or self.pending_outputs or remote)

    def get_stats(self) -> SchedulerStats:
        """Cumulative counters since start, and the current queue sizes and KV usage
        (requests whose pulled KV is on its way or landed count as waiting, as in vLLM)."""
        num_waiting = len(self.waiting)
        if self.remote_kv is not None:
            loading = self.remote_kv.loading.values()
            num_waiting += sum(not r.is_finished for r in loading) + len(self.remote_kv.ready)
        stats = self.counters.make_stats(self.kv_cache_manager, len(self.running), num_waiting)
        if self.spec is not None:
            self.spec.counters.fill(stats)
        if self.remote_kv is not None:
            self.remote_kv.fill(stats)
        return stats


def _mostly_prefill(num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list]) -> bool:
    """Whether a step's prefill tokens outnumber its decoding requests (each of which
    decodes one token and verifies its drafts)."""
    num_decoding = num_prefill = 0
    for request_id, num_new in num_scheduled_tokens.items():
        if num_new == 1 + len(spec_tokens.get(request_id, ())):
            num_decoding += 1
        else:
            num_prefill += num_new
    return num_prefill > num_decoding
