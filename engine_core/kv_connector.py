"""The EngineCore's half of a KV connector (vLLM's KVConnectorBase_V1 in its scheduler
role), and ZmqConnector's.

The scheduler asks a connector four things: how many of a waiting request's tokens it
can load from elsewhere (`get_num_new_matched_tokens`), what to load into the blocks it
then allocated (`update_state_after_alloc`), what the workers must hear this step
(`build_connector_meta`), and whether a finished request's blocks must outlive it
(`request_finished`). The workers' half (worker/kv_connector.py) moves the pages and
reports, in each step's answer, the transfers every rank has finished
(`update_connector_output`).

ZmqConnector: a producer keeps a finished request's blocks and answers with
kv_transfer_params naming a fresh transfer id, the blocks, an end time and a key (an HMAC
of them, ipc/kv_transfer.py); its workers serve the pages once to whoever presents them,
and stop when the time runs out: then the blocks are freed and the transfer revoked in the
next step's metadata, before any step may reuse them. A consumer pulls all but the last
prompt token's KV into blocks it allocated for them (not yet cached: nothing may hit them
before they land), then computes that last token itself: its logits give the first output
token.
"""

from __future__ import annotations

import logging
import secrets
import time
from abc import ABC, abstractmethod

from engine_core.request import Request, RequestStatus
from ipc.config import EngineConfig
from ipc.kv_transfer import (
    KVTransferParams,
    prompt_hash,
    shared_credentials,
    transfer_key,
    transfer_secret,
)
from ipc.messages import KVConnectorMetadata, KVConnectorOutput, KVRecv, KVSend
from kv_cache import NULL_BLOCK_ID

logger = logging.getLogger(__name__)

# Finished this way, a producer's request keeps its KV for a consumer.
_HANDED_OVER = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class KVConnectorScheduler(ABC):
    @abstractmethod
    def check_request(self, request: Request) -> str | None:
        """Why the request's kv_transfer_params cannot be honoured here, or None."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens after the `num_computed_tokens` found locally whose KV the connector can
        load, and whether it loads them asynchronously (the request then waits for them)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[list[int]], num_external_tokens: int
    ) -> None:
        """The request's blocks (per group) now hold room for those tokens after its
        `num_computed_tokens`."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """What the workers must hear this step; None: nothing (no step needed for it)."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[list[int]]
    ) -> tuple[bool, KVTransferParams | None]:
        """Whether to keep the finished request's blocks until the workers report them sent,
        and the kv_transfer_params for its answer."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Transfers the workers finished."""

    @abstractmethod
    def take_expired(self) -> list[str]:
        """Requests whose kept blocks nobody pulled in time: free them now (the workers
        hear of it before any step may reuse them)."""

    @abstractmethod
    def reset(self) -> None:
        """The workers were replaced: every transfer in flight is gone."""


class ZmqConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig) -> None:
        transfer = config.kv_transfer_config
        self.config = transfer
        self.block_size = config.block_size
        self.tp_size = config.tensor_parallel_size
        self.port = transfer.kv_port + config.data_parallel_rank * config.tensor_parallel_size
        self.send_timeout = float(transfer.extra("send_timeout_s"))
        self.secret = (
            transfer_secret(shared_credentials(transfer.credentials_path))
            if transfer.is_producer
            else b""
        )
        self._new_sends: list[KVSend] = []
        self._new_recvs: list[KVRecv] = []
        self._revoked: list[str] = []
        self._sending: dict[str, tuple[str, float]] = {}  # request id -> (transfer id, end)
        self._recving: set[str] = set()

    def check_request(self, request: Request) -> str | None:
        params = request.sampling_params.kv_transfer_params
        if params is None:
            return None
        if params.do_remote_decode and not self.config.is_producer:
            return (
                "kv_transfer_params do_remote_decode needs a KV producer; this instance's "
                f"kv_role is {self.config.kv_role}"
            )
        if params.do_remote_prefill and not self.config.is_consumer:
            return (
                "kv_transfer_params do_remote_prefill needs a KV consumer; this instance's "
                f"kv_role is {self.config.kv_role}"
            )
        return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.sampling_params.kv_transfer_params
        if params is None or not params.do_remote_prefill or request.remote_prefill_tried:
            return 0, False
        if request.wants_prompt_logprobs:  # pulled positions would give no logits
            return 0, False
        request.remote_prefill_tried = True  # once: a preempted request recomputes
        num_external = request.num_prompt_tokens - 1 - num_computed_tokens
        if num_external <= 0 or request.num_output_tokens:
            return 0, False
        num_positions = -(-(request.num_prompt_tokens - 1) // self.block_size)
        problem = None
        if params.remote_tp_size != self.tp_size:
            problem = f"tensor parallel size {params.remote_tp_size}, here {self.tp_size}"
        elif params.prompt_hash != prompt_hash(request.prompt_token_ids):
            problem = "another prompt"
        elif any(len(ids) < num_positions for ids in params.remote_block_ids):
            problem = "too few blocks"
        elif any(NULL_BLOCK_ID in ids[:num_positions] for ids in params.remote_block_ids):
            # A sliding-window group dropped blocks before its window; pulled, their pages
            # would be cached here as if they held the prompt.
            problem = "blocks dropped outside a sliding window"
        elif params.expires < time.time():
            problem = "its time ran out"
        if problem is not None:
            logger.warning(
                "request %s: the producer's KV does not fit (%s); computing its prompt",
                request.request_id,
                problem,
            )
            return 0, False
        return num_external, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[list[int]], num_external_tokens: int
    ) -> None:
        params = request.sampling_params.kv_transfer_params
        first = request.num_computed_tokens // self.block_size
        end = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        self._new_recvs.append(
            KVRecv(
                request.request_id,
                [ids[first:end] for ids in block_ids],
                first,
                params.remote_host,
                params.remote_port,
                params.transfer_id,
                params.transfer_key,
                params.remote_block_ids,
                params.expires,
            )
        )
        self._recving.add(request.request_id)

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        pending = bool(self._sending or self._recving)
        if not (pending or self._new_sends or self._new_recvs or self._revoked):
            return None
        metadata = KVConnectorMetadata(self._new_sends, self._new_recvs, self._revoked)
        self._new_sends, self._new_recvs, self._revoked = [], [], []
        return metadata

    def request_finished(
        self, request: Request, block_ids: list[list[int]]
    ) -> tuple[bool, KVTransferParams | None]:
        params = request.sampling_params.kv_transfer_params
        if params is None or not params.do_remote_decode or request.status not in _HANDED_OVER:
            return False, None
        transfer_id = secrets.token_urlsafe(12)
        expires = round(time.time() + self.send_timeout, 3)
        engine_id = self.config.engine_id
        key = transfer_key(self.secret, engine_id, self.port, transfer_id, block_ids, expires)
        self._new_sends.append(KVSend(request.request_id, transfer_id))
        self._sending[request.request_id] = (transfer_id, expires)
        return True, KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.config.engine_id,
            remote_block_ids=block_ids,
            remote_host=self.config.kv_ip,
            remote_port=self.port,
            remote_tp_size=self.tp_size,
            transfer_id=transfer_id,
            transfer_key=key,
            prompt_hash=prompt_hash(request.prompt_token_ids),
            expires=expires,
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in output.finished_sending:
            self._sending.pop(request_id, None)
        self._recving.difference_update(output.finished_recving)
        self._recving.difference_update(output.failed_recving)

    def take_expired(self) -> list[str]:
        now = time.time()
        expired = [r for r, (_, expires) in self._sending.items() if expires < now]
        for request_id in expired:
            transfer_id, _ = self._sending.pop(request_id)
            self._revoked.append(transfer_id)
            logger.warning("request %s: nobody pulled its KV in time", request_id)
        return expired

    def reset(self) -> None:
        self._new_sends, self._new_recvs, self._revoked = [], [], []
        self._sending.clear()
        self._recving.clear()


def make_kv_connector(config: EngineConfig) -> KVConnectorScheduler | None:
    if config.kv_transfer_config is None:
        return None
    return ZmqConnectorScheduler(config)
