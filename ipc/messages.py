"""Every message that crosses a process boundary, as msgspec structs.

Top-level messages are tagged (the class name leads the array), so one decoder can
take a union of them from a socket. Nested structs are plain arrays. Nothing here is
pickled; a frame that does not decode into the expected struct raises `DecodeError`.
"""

from __future__ import annotations

import enum

import msgspec

from ipc.kv_transfer import KVTransferParams
from ipc.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished: an int on the wire; `str()` gives the API's name."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class ErrorCode(enum.IntEnum):
    """Why a request finished with "error", as the HTTP status a server answers with.
    INVALID_REQUEST messages are meant for the client; INTERNAL ones stay in the logs
    (the client gets a generic message); UNAVAILABLE: the engine is shutting down."""

    INVALID_REQUEST = 400
    INTERNAL = 500
    UNAVAILABLE = 503


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


class _Tagged(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class TokenLogprobs(_Wire):
    """Logprobs at one position: index 0 is the sampled token (for prompt logprobs, the
    prompt's token), then the top-k. `rank`: token 0's rank in the vocabulary (1 = most
    likely)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int | None = None


class PromptLogprobs(_Wire):
    """Prompt logprobs of one step's chunk of a prompt: `logprobs[i]` is that of prompt
    token `start + i` (start >= 1)."""

    start: int
    logprobs: list[TokenLogprobs]


# Client -> EngineCore


class EngineCoreRequest(_Tagged):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None


class AbortRequests(_Tagged):
    request_ids: list[str]


class UtilityRequest(_Tagged):
    """A small call on the EngineCore: "stats", "reset_prefix_cache", "health"."""

    call_id: int
    method: str


# EngineCore -> client


class RequestStats(_Wire):
    """A finished request as the EngineCore saw it: seconds waiting to be first scheduled,
    from then to its first token, and from that to its last; times it was preempted."""

    queued: float
    prefill: float
    decode: float
    num_preemptions: int = 0


class EngineCoreOutput(_Wire):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    error_code: ErrorCode = ErrorCode.INVALID_REQUEST
    # The prompt logprobs not sent before, in prompt order from prompt token 1.
    prompt_logprobs: list[TokenLogprobs] | None = None
    request_stats: RequestStats | None = None  # on the last output of one that generated
    # A KV producer's last output of a request that asked do_remote_decode: where a
    # consumer pulls its KV (ipc/kv_transfer.py).
    kv_transfer_params: KVTransferParams | None = None


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class SchedulerStats(_Wire):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # The EngineCore process's step profile: cumulative seconds over the steps that ran
    # the model, split into scheduling, sending the SchedulerOutput to the workers,
    # waiting for rank 0's answer, and update_from_output.
    num_steps: int = 0
    schedule_time: float = 0.0
    broadcast_time: float = 0.0
    wait_time: float = 0.0
    update_time: float = 0.0
    # KV host tier, cumulative: blocks copied out by swap preemption, copied back in (swap
    # resumes and host-tier prefix hits), spilled on eviction from the device prefix cache;
    # prompt tokens served by host-tier hits (also counted in prefix_cache_hits).
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_spilled_blocks: int = 0
    host_cache_hits: int = 0
    # Cumulative seconds rank 0 waited for the next step with its device idle: the part
    # of the EngineCore's work (and transport) that async scheduling did not hide.
    worker_idle_time: float = 0.0
    # Steps by the tokens they scheduled: iteration_tokens[i] steps had more than
    # ITERATION_TOKEN_BUCKETS[i - 1] and at most ITERATION_TOKEN_BUCKETS[i] (the last
    # entry: more than every bound); and those steps' tokens, summed.
    iteration_tokens: list[int] = []
    iteration_tokens_sum: int = 0
    # The KV cache's fixed settings, as the labels of vLLM's cache_config_info metric.
    cache_config_info: dict[str, str] = {}
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters): verifications (one
    # request's drafts in one step), their draft tokens, the accepted ones, and the
    # accepted ones by draft position (index 0: the first draft).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # Prefill/decode disaggregation, cumulative: a consumer's pulls that landed and failed,
    # their bytes and seconds; a producer's requests whose KV was served (or expired).
    kv_transfer_pulls: int = 0
    kv_transfer_failed_pulls: int = 0
    kv_transfer_pulled_bytes: int = 0
    kv_transfer_pull_seconds: float = 0.0
    kv_transfer_sends: int = 0


class EngineCoreOutputs(_Tagged):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None


class UtilityOutput(_Tagged):
    """The answer to a UtilityRequest; call_id -1 reports a frame the engine could not
    decode."""

    call_id: int
    result: bool | SchedulerStats | None = None
    error: str | None = None


# EngineCore -> workers


class NewRequestData(_Wire):
    """A request the workers have not seen. `block_ids[g]` are its blocks in KV cache
    group g. `output_token_ids` is empty but for a request replayed onto fresh workers
    after a worker failure: then it holds what was generated."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    num_computed_tokens: int
    output_token_ids: list[int] = []


class CachedRequestData(_Wire):
    """Requests the workers already know. `new_block_ids[i][g]` holds only the blocks
    added this step in KV cache group g, except for a request resumed from preemption:
    then it holds the whole block lists and `new_token_ids[i]` all its tokens (prompt
    and output)."""

    req_ids: list[str] = []
    resumed_from_preemption: list[bool] = []
    new_token_ids: list[list[int]] = []
    new_block_ids: list[list[list[int]]] = []
    num_computed_tokens: list[int] = []


class KVSend(_Wire):
    """A finished request whose blocks the EngineCore keeps until the workers report its
    transfer served (its key lets them serve it before they hear of it here)."""

    request_id: str
    transfer_id: str


class KVRecv(_Wire):
    """Pages a consumer's workers pull into `block_ids` (per group): the producer's
    `remote_block_ids` from position `first_block` on, as many per group, from
    host:port + rank, naming the transfer by its id, key and end."""

    request_id: str
    block_ids: list[list[int]]
    first_block: int
    host: str
    port: int
    transfer_id: str
    key: str
    remote_block_ids: list[list[int]]
    expires: float


class KVConnectorMetadata(_Wire):
    """The KV connector's news for the workers this step: new sends and pulls, and the
    transfers whose time ran out (their blocks may be reused from this step on: serve them
    no more). Sent, empty if need be, with every step while transfers are unfinished (a
    step with no tokens runs for it), so that the workers can report them."""

    sends: list[KVSend] = []
    recvs: list[KVRecv] = []
    revoked: list[str] = []


class KVConnectorOutput(_Wire):
    """Transfers every rank has finished: request ids whose blocks were served (or whose
    time ran out), whose pulls landed, and whose pulls failed (-> why); the landed pulls'
    bytes (every rank's) and seconds (rank 0's, from start to landing, summed)."""

    finished_sending: list[str] = []
    finished_recving: list[str] = []
    failed_recving: dict[str, str] = {}
    pulled_bytes: int = 0
    pull_seconds: float = 0.0


class SchedulerOutput(_Tagged):
    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = []
    # Structured output: one bitmask row per request listed, for the requests that sample
    # this step; each row cdiv(vocab_size, 32) little-endian int32 words, bit j of word w
    # set when token 32 * w + j is allowed (llguidance's layout).
    structured_output_request_ids: list[str] = []
    grammar_bitmask: bytes = b""
    # KV host tier: (device block, host block) copies and then (host block, device block)
    # copies the workers run before the forward. No block appears twice in one step.
    blocks_to_swap_out: list[tuple[int, int]] = []
    blocks_to_swap_in: list[tuple[int, int]] = []
    # The EngineCore waits for this step's answer before it schedules another (no async
    # scheduling, a structured-output request is live, or the step speculates): answer it
    # as soon as it ends.
    lockstep: bool = False
    # Speculative decoding: request id -> the draft tokens that follow its last known
    # token. Such a request's num_scheduled_tokens is 1 + len(drafts); the workers verify
    # the drafts and answer with the accepted ones plus one token of their own.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # A draft model runs in the workers: after this step, draft the next tokens of every
    # request that sampled (their slots were allocated as lookahead), for the next step.
    propose_drafts: bool = False
    kv_connector_metadata: KVConnectorMetadata | None = None


# Worker -> EngineCore


class ModelRunnerOutput(_Tagged):
    """`failed_requests`: request id -> why the workers could not take it (that request
    fails, the rest of the batch runs). `prompt_logprobs`: request id -> the prompt
    logprobs of its tokens computed this step (only requests that asked)."""

    step_id: int
    req_ids: list[str]
    # Per request: its sampled token, or with drafts the accepted drafts and then one
    # token sampled after them (empty: it sampled nothing this step).
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    failed_requests: dict[str, str] = {}
    prompt_logprobs: dict[str, PromptLogprobs] = {}
    # Seconds rank 0 waited for this step with nothing left running on its device.
    worker_idle_time: float = 0.0
    # A draft model's proposals (SchedulerOutput.propose_drafts): request id -> the tokens
    # it drafts after that request's last sampled token.
    draft_token_ids: dict[str, list[int]] = {}
    kv_connector_output: KVConnectorOutput | None = None


class WorkerError(_Tagged):
    rank: int
    message: str
    step_id: int | None = None


class WorkerReady(_Tagged):
    """`kv_cache_groups` holds each KV cache group's sliding window (None: full
    attention), in the group order block ids travel in."""

    rank: int
    num_kv_blocks: int
    pid: int = 0
    hostname: str = ""
    kv_cache_groups: list[int | None] = msgspec.field(default_factory=lambda: [None])
    # KV host tier (config.kv_offload_memory): the host blocks that fit, and the measured
    # seconds to copy one block one way and to prefill one token (swap-or-recompute costs).
    num_host_blocks: int = 0
    block_copy_seconds: float = 0.0
    prefill_token_seconds: float = 0.0
    # "cuda" or "cpu": where the worker runs its steps.
    device_type: str = "cpu"


class KVCacheReady(_Tagged):
    """A rank's answer to InitKVCache: its KV cache is allocated (and on CUDA its graphs
    captured), so it can run steps. The EngineCore reports ready only after every rank's."""

    rank: int


# EngineCore -> workers, outside steps


class InitKVCache(_Tagged):
    """The block counts every rank allocates: the minimum over the ranks' WorkerReady."""

    num_blocks: int
    num_host_blocks: int = 0


class FinishStep(_Tagged):
    """Answer step `step_id` as soon as it ends. A worker answers a step not sent in
    `lockstep` once it has launched the next one; the EngineCore sends this when it waits
    for such a step after all and has sent no later step (under async scheduling: the
    next schedule came out empty, or a structured-output request arrived)."""

    step_id: int


class Shutdown(_Tagged):
    pass


# The messages each socket carries, each way (what a Decoder on that side expects).
FROM_CLIENTS = (EngineCoreRequest, AbortRequests, UtilityRequest)
TO_CLIENTS = (EngineCoreOutputs, UtilityOutput)
TO_WORKERS = (SchedulerOutput, FinishStep, InitKVCache, Shutdown)
FROM_WORKERS = (ModelRunnerOutput, WorkerError, WorkerReady, KVCacheReady)


class DecodeError(ValueError):
    """A frame that is not a valid message of the expected type."""


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


class Decoder:
    """Decodes frames into one of `types`; anything else raises `DecodeError`."""

    def __init__(self, *types: type) -> None:
        target = types[0] if len(types) == 1 else _union(types)
        self._decoder = msgspec.msgpack.Decoder(target)
        self._names = " | ".join(t.__name__ for t in types)

    def decode(self, frame: bytes | memoryview):
        try:
            return self._decoder.decode(frame)
        # msgspec lets invalid UTF-8 in a string escape as UnicodeDecodeError.
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
            raise DecodeError(f"bad frame, expected {self._names}: {e}") from None


def _union(types: tuple[type, ...]):
    union = types[0]
    for t in types[1:]:
        union = union | t
    return union


_encoder = msgspec.msgpack.Encoder()
