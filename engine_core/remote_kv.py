"""RemoteKV: the scheduler's bookkeeping around a KV connector (kv_connector.py).

Three kinds of requests hold KV blocks outside the running and waiting lists:

* `loading`: a consumer's requests whose prompt KV is being pulled into blocks allocated
  for it (uncached until it lands). When the pull fails, the request goes back to the
  front of the queue with its blocks freed, to be computed from scratch. An aborted one
  keeps its blocks until its pull ends: the workers may still be writing them.
* `ready`: those whose pull landed: all but the last prompt token computed, admitted
  before the queue. One that does not fit, and any of them when a running request needs
  blocks, gives its blocks back (`release_ready`) and is computed like any other: blocks
  held by requests that do not run must never starve those that could.
* `held`: a producer's finished requests whose blocks wait until the workers report them
  pulled (or withdrawn after their time).

Their ids stay in use meanwhile: the KV cache manager keys blocks by request id.
"""

from __future__ import annotations

import logging
from collections import deque

from engine_core.kv_connector import KVConnectorScheduler
from engine_core.request import Request, RequestStatus
from ipc.kv_transfer import KVTransferParams
from ipc.messages import KVConnectorMetadata, KVConnectorOutput, SchedulerStats
from kv_cache import KVCacheBlocks, KVCacheManager

logger = logging.getLogger(__name__)

_COUNTERS = (
    "kv_transfer_pulls",
    "kv_transfer_failed_pulls",
    "kv_transfer_pulled_bytes",
    "kv_transfer_pull_seconds",
    "kv_transfer_sends",
)


def kv_transfer_error(request: Request, remote_kv: RemoteKV | None) -> str | None:
    """Why the request's kv_transfer_params cannot be honoured here, or None."""
    if request.sampling_params.kv_transfer_params is None:
        return None
    if remote_kv is None:
        return "kv_transfer_params needs an instance started with --kv-transfer-config"
    return remote_kv.connector.check_request(request)


class RemoteKV:
    def __init__(self, connector: KVConnectorScheduler, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv_cache_manager
        self.loading: dict[str, Request] = {}
        self.ready: deque[Request] = deque()
        self.held: dict[str, Request] = {}
        self.counts = SchedulerStats()  # only its kv_transfer_* counters

    def owns(self, request_id: str) -> bool:
        return request_id in self.loading or request_id in self.held

    @property
    def has_requests(self) -> bool:
        return bool(self.loading or self.ready or self.held)

    def start_load(
        self, request: Request, hit_blocks: KVCacheBlocks | None, num_hit_tokens: int
    ) -> bool | None:
        """If the connector loads tokens after the request's `num_hit_tokens` prefix hits,
        give them blocks and let the request wait for them (True), or report that they do
        not fit (False). None: nothing to load."""
        num_external, _ = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if not num_external:
            return None
        new_blocks = self.kv.allocate_slots(
            request, num_external, num_hit_tokens, hit_blocks, delay_cache_blocks=True
        )
        if new_blocks is None:
            return False
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        block_ids = self.kv.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        return True

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """This step's metadata; blocks kept past their time are freed first (the
        metadata revokes their transfers before this step may reuse them)."""
        for request_id in self.connector.take_expired():
            request = self.held.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
                self.counts.kv_transfer_sends += 1
        return self.connector.build_connector_meta()

    def update(self, output: KVConnectorOutput) -> list[Request]:
        """Free the blocks that were pulled; make the requests whose pull landed ready;
        the requests whose pull failed, to requeue."""
        self.connector.update_connector_output(output)
        counts = self.counts
        counts.kv_transfer_pulls += len(output.finished_recving)
        counts.kv_transfer_failed_pulls += len(output.failed_recving)
        counts.kv_transfer_pulled_bytes += output.pulled_bytes
        counts.kv_transfer_pull_seconds += output.pull_seconds
        counts.kv_transfer_sends += len(output.finished_sending)
        for request_id in output.finished_sending:
            request = self.held.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
        failed = output.failed_recving
        requeue = []
        for request_id in [*output.finished_recving, *failed]:
            request = self.loading.pop(request_id, None)
            if request is None:
                continue
            if request.is_finished or request_id in failed:
                self.kv.free(request)
                request.num_computed_tokens = 0
                if request.is_finished:
                    continue
                logger.warning(
                    "request %s: pulling its KV failed (%s); computing its prompt",
                    request_id,
                    failed[request_id],
                )
                request.status = RequestStatus.WAITING
                requeue.append(request)
            else:
                request.num_computed_tokens = request.num_prompt_tokens - 1
                self.kv.cache_blocks(request, request.num_computed_tokens)
                request.status = RequestStatus.WAITING
                self.ready.append(request)
        return requeue

    def release_ready(self) -> Request:
        """The latest ready request, its blocks freed: to queue, to be computed."""
        request = self.ready.pop()
        self.kv.free(request)
        request.num_computed_tokens = 0
        return request

    def finish(self, request: Request, was_loading: bool) -> KVTransferParams | None:
        """Free a finished request's blocks, unless its pull still runs or a consumer is
        to pull them; then the kv_transfer_params for its answer are returned."""
        if was_loading:
            return None
        if request in self.ready:
            self.ready.remove(request)
        keep, params = self.connector.request_finished(
            request, self.kv.get_block_ids(request.request_id)
        )
        if keep:
            self.held[request.request_id] = request
        else:
            self.kv.free(request)
        return params

    def fill(self, stats: SchedulerStats) -> None:
        for name in _COUNTERS:
            setattr(stats, name, getattr(self.counts, name))

    def reset(self) -> list[Request]:
        """The workers were replaced, and every transfer with them: free every block; the
        unfinished requests that were loading, to requeue (computed from scratch)."""
        requeue = []
        for request in [*self.held.values(), *self.loading.values(), *self.ready]:
            self.kv.free(request)
            request.num_computed_tokens = 0
            if not request.is_finished and request.request_id not in self.held:
                request.status = RequestStatus.WAITING
                requeue.append(request)
        self.held.clear()
        self.loading.clear()
        self.ready.clear()
        self.connector.reset()
        return requeue
