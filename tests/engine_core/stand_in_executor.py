"""A deterministic stand-in for the workers, for scheduler tests.

It keeps the worker's view of every request, built only from what the SchedulerOutputs
say (after a trip through the wire codec), samples a scripted token for each request
whose tokens are all computed, and checks its block lists against the KV cache manager.
It also models the KV cache's contents (which group's token each slot holds): every
token a step attends to (a sliding-window group: the window before each new token) must
have been written by an earlier step of these workers into that group's block, so a
prefix hit on a block they never computed, or one of another group, is caught. With a host
tier (`num_host_blocks`) it models the host blocks' contents too and runs each step's
copies before the step (all swap-outs, then all swap-ins), as ModelRunner does. Steps
listed in `fail_steps` fail as dead workers do; replacing the workers forgets every
request and the cache, as fresh workers would. Drafts (speculative decoding) are verified
against the scripted stream: accepted while they equal it, then one scripted token; the
rejected drafts' KV stays written, so a step that reads it (a rollback gone wrong) is
caught as a stale read. With `draft` it stands in for a draft model too: after a step
whose SchedulerOutput says propose_drafts, each request that produced tokens gets the
first k of `draft(request_id, token_ids)`, cut where its blocks end; its last token and
the drafts but the last are written into the slots after it, as a draft model's decode
rounds do (so a step that reads them before rewriting them is a stale read). It stands in
for a KV connector's workers too: a pull lands one step after it starts, writing
`remote_kv[request_id]` (the producer's prompt) into its blocks, or fails if its request is
in `fail_recvs`; a send finishes once its request is in `pulled`.
"""

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core import EngineConfig, EngineCore, Executor
from ipc.executor import WorkerFailure, WorkerGroupSpec
from ipc.kv_transfer import KVTransferParams, prompt_hash
from ipc.messages import (
    Decoder,
    EngineCoreOutputs,
    EngineCoreRequest,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVRecv,
    KVSend,
    ModelRunnerOutput,
    SchedulerOutput,
    encode,
)
from ipc.sampling_params import SamplingParams

DEFAULT_TOKEN = 7

_decoder = Decoder(SchedulerOutput)


@dataclass
class WorkerRequestState:
    token_ids: list[int]
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    num_prompt_tokens: int


@dataclass
class StandInExecutor(Executor):
    """`sample(request_id, token_ids)` gives the next token; by default `script[request_id]`
    indexed by the output position, or DEFAULT_TOKEN once the script runs out."""

    num_blocks: int
    script: dict[str, list[int]] = field(default_factory=dict)
    sample: Callable[[str, list[int]], int] | None = None
    draft: Callable[[str, list[int]], list[int]] | None = None
    max_model_len: int = 0
    num_speculative_tokens: int = 0
    kv_cache_manager: object = None
    outputs: list[SchedulerOutput] = field(default_factory=list)
    states: dict[str, WorkerRequestState] = field(default_factory=dict)
    fail_steps: set[int] = field(default_factory=set)
    num_failures: int = 0
    num_replacements: int = 0
    # (block, offset) -> (group, token), on the device and in the host tier
    kv: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    host_kv: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    # What the workers report (WorkerGroupSpec): sliding windows, host tier, measured
    # (block copy, prefill token) seconds, device.
    kv_cache_groups: tuple[int | None, ...] = (None,)
    num_host_blocks: int = 0
    costs: tuple[float, float] = (0.0, 0.0)
    device_type: str = "cpu"
    worker_processes: bool = False
    # The engine schedules a step before the previous one ran (async scheduling).
    schedules_ahead: bool = False
    # KV connector: the producer's prompt per pulled request, pulls to fail, sends pulled;
    # sends served and not yet pulled, pulls started last step.
    remote_kv: dict[str, list[int]] = field(default_factory=dict)
    fail_recvs: set[str] = field(default_factory=set)
    pulled: set[str] = field(default_factory=set)
    sends: dict[str, KVSend] = field(default_factory=dict)
    recvs: list[KVRecv] = field(default_factory=list)

    def initialize_workers(self) -> WorkerGroupSpec:
        return WorkerGroupSpec(
            self.num_blocks,
            self.kv_cache_groups,
            self.num_host_blocks,
            *self.costs,
            self.device_type,
            self.worker_processes,
        )

    def replace_workers(self, spec: WorkerGroupSpec) -> None:
        assert spec == self.initialize_workers()
        self.states.clear()
        self.kv.clear()
        self.host_kv.clear()
        self.sends.clear()
        self.recvs.clear()
        self.num_replacements += 1

    def shutdown(self) -> None:
        self.states.clear()

    def _next_token(self, request_id: str, state: WorkerRequestState) -> int:
        if self.sample is not None:
            return self.sample(request_id, state.token_ids)
        script = self.script.get(request_id, [])
        position = len(state.token_ids) - state.num_prompt_tokens
        return script[position] if position < len(script) else DEFAULT_TOKEN

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = _decoder.decode(encode(scheduler_output))
        assert so == scheduler_output
        if so.step_id in self.fail_steps:
            self.num_failures += 1
            raise WorkerFailure(f"worker rank 0 died at step {so.step_id}")
        self.outputs.append(so)
        self._copy_blocks(so)
        kv_output = self._kv_transfers(so.kv_connector_metadata)
        self._update_states(so)
        scheduled = [r.req_id for r in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
        assert sorted(scheduled) == sorted(so.num_scheduled_tokens)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        sampled = []
        attending = []
        verifying = []
        for request_id in scheduled:
            state = self.states[request_id]
            num_new = so.num_scheduled_tokens[request_id]
            assert num_new > 0
            drafts = so.scheduled_spec_decode_tokens.get(request_id, [])
            if drafts:
                assert num_new == 1 + len(drafts)
                assert state.num_computed_tokens == len(state.token_ids) - 1
                verifying.append((request_id, state, len(state.token_ids)))
                state.token_ids.extend(drafts)
            start = state.num_computed_tokens
            state.num_computed_tokens += num_new
            assert state.num_computed_tokens <= len(state.token_ids)
            if self.kv_cache_manager is not None:
                self._check_block_ids(request_id, state)
                block_size = self.kv_cache_manager.block_size
                for ids in state.block_ids:
                    assert len(ids) * block_size >= state.num_computed_tokens
                self._store(state, start, block_size)
                attending.append((state, start, block_size))
            if drafts:
                sampled.append(None)  # verified below, once every token is stored
            elif state.num_computed_tokens == len(state.token_ids):
                state.token_ids.append(self._next_token(request_id, state))
                sampled.append([state.token_ids[-1]])
            else:
                sampled.append([])
        for args in attending:
            self._check_context(*args)
        for request_id, state, num_known in verifying:
            sampled[scheduled.index(request_id)] = self._verify(request_id, state, num_known)
        proposed = {}
        if so.propose_drafts:
            assert self.draft is not None, "propose_drafts without a draft model"
            for request_id, tokens in zip(scheduled, sampled, strict=True):
                if tokens:
                    proposed[request_id] = self._propose(request_id, self.states[request_id])
        return ModelRunnerOutput(
            so.step_id,
            scheduled,
            sampled,
            draft_token_ids=proposed,
            kv_connector_output=kv_output,
        )

    def _kv_transfers(self, metadata: KVConnectorMetadata | None) -> KVConnectorOutput | None:
        if metadata is None:
            return None
        out = KVConnectorOutput([], [], {})
        for recv in self.recvs:
            if recv.request_id in self.fail_recvs:
                out.failed_recving[recv.request_id] = "stand-in pull failed"
            else:
                self._land(recv)
                out.finished_recving.append(recv.request_id)
        self.recvs = list(metadata.recvs)
        for send in metadata.sends:
            assert send.request_id not in self.sends
            self.sends[send.request_id] = send
        for request_id in [r for r in self.sends if r in self.pulled]:
            del self.sends[request_id]
            out.finished_sending.append(request_id)
        return out

    def _land(self, recv: KVRecv) -> None:
        prompt = self.remote_kv[recv.request_id]
        block_size = self.kv_cache_manager.block_size
        for group, ids in enumerate(recv.block_ids):
            for i, block in enumerate(ids):
                assert block != 0, "a pull into the null block"
                for offset in range(block_size):
                    position = (recv.first_block + i) * block_size + offset
                    if position < len(prompt):
                        self.kv[block, offset] = (group, prompt[position])

    def _propose(self, request_id: str, state: WorkerRequestState) -> list[int]:
        """The lookahead slots must cover the drafts, up to max_model_len."""
        drafts = self.draft(request_id, list(state.token_ids))[: self.num_speculative_tokens]
        start = len(state.token_ids) - 1
        if self.kv_cache_manager is None:
            return drafts
        block_size = self.kv_cache_manager.block_size
        end = min(start + len(drafts), self.max_model_len)
        for ids in state.block_ids:
            assert len(ids) * block_size >= end, "no lookahead slots for the drafts"
        written = [state.token_ids[-1], *drafts[: end - start - 1]]
        for group, ids in enumerate(state.block_ids):
            for position, token in enumerate(written, start):
                self.kv[ids[position // block_size], position % block_size] = (group, token)
        return drafts[: end - start]

    def _verify(self, request_id: str, state: WorkerRequestState, num_known: int) -> list[int]:
        """Keep the drafts while they match the script, then one scripted token; the next
        step starts at the last of them, as the scheduler's rollback says."""
        drafts = state.token_ids[num_known:]
        del state.token_ids[num_known:]
        produced = []
        while True:
            token = self._next_token(request_id, state)
            state.token_ids.append(token)
            produced.append(token)
            if len(produced) > len(drafts) or token != drafts[len(produced) - 1]:
                break
        state.num_computed_tokens = len(state.token_ids) - 1
        return produced

    def _update_states(self, so: SchedulerOutput) -> None:
        """The workers' view of the requests, as worker/batch_update.py keeps it
        (tests/worker/test_stand_in_contract.py holds the two to the same contract)."""
        for request_id in so.finished_req_ids:
            self.states.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            self.states[new.req_id] = WorkerRequestState(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                [list(ids) for ids in new.block_ids],
                new.num_computed_tokens,
                len(new.prompt_token_ids),
            )
        cached = so.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            state = self.states[request_id]
            if cached.resumed_from_preemption[i]:
                state.token_ids = list(cached.new_token_ids[i])
                state.block_ids = [list(ids) for ids in cached.new_block_ids[i]]
            else:
                assert cached.new_token_ids[i] == []
                assert cached.num_computed_tokens[i] == state.num_computed_tokens
                for ids, new_ids in zip(state.block_ids, cached.new_block_ids[i], strict=True):
                    ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def _check_block_ids(self, request_id: str, state: WorkerRequestState) -> None:
        """The workers' block lists are the KV cache manager's. With async scheduling the
        manager is one schedule ahead: it may have added blocks, dropped blocks before a
        window (steps run in order, so a block's next owner writes it after this step), or
        preempted the request."""
        manager_ids = self.kv_cache_manager.get_block_ids(request_id)
        if not self.schedules_ahead:
            assert state.block_ids == manager_ids
            return
        if not any(manager_ids):
            return
        for ids, ahead in zip(state.block_ids, manager_ids, strict=True):
            assert len(ahead) >= len(ids)
            assert all(b in (a, 0) for a, b in zip(ids, ahead, strict=False))

    def _copy_blocks(self, so: SchedulerOutput) -> None:
        pairs = so.blocks_to_swap_out + so.blocks_to_swap_in
        if not pairs:
            return
        assert self.num_host_blocks > 0, "block copies without a host tier"
        for device_block, host_block in so.blocks_to_swap_out:
            assert 0 < device_block < self.num_blocks and 0 < host_block < self.num_host_blocks
        for host_block, device_block in so.blocks_to_swap_in:
            assert 0 < device_block < self.num_blocks and 0 < host_block < self.num_host_blocks
        host_blocks = [h for _, h in so.blocks_to_swap_out] + [h for h, _ in so.blocks_to_swap_in]
        assert len(set(host_blocks)) == len(host_blocks), "a host block twice in one step"
        block_size = self.kv_cache_manager.block_size
        for device_block, host_block in so.blocks_to_swap_out:
            _copy_block(self.kv, device_block, self.host_kv, host_block, block_size)
        for host_block, device_block in so.blocks_to_swap_in:
            _copy_block(self.host_kv, host_block, self.kv, device_block, block_size)

    def _store(self, state: WorkerRequestState, start: int, block_size: int) -> None:
        for group, ids in enumerate(state.block_ids):
            for position in range(start, state.num_computed_tokens):
                block = ids[position // block_size]
                assert block != 0, "a token stored into the null block"
                self.kv[block, position % block_size] = (group, state.token_ids[position])

    def _check_context(self, state: WorkerRequestState, start: int, block_size: int) -> None:
        """Each group's context of the first new token (position `start`) must hold the
        request's tokens: positions 0..start-1, or for a window W the last W - 1 of them.
        A step stores every new token before any attention reads (as each attention layer
        does), so a block cached by one request this step can be read by another this
        same step."""
        for group, (ids, window) in enumerate(
            zip(state.block_ids, self.kv_cache_groups, strict=True)
        ):
            first = 0 if window is None else max(0, start - window + 1)
            for position in range(first, start):
                slot = (ids[position // block_size], position % block_size)
                assert self.kv.get(slot) == (group, state.token_ids[position]), "stale KV read"


def _copy_block(source: dict, src: int, target: dict, dst: int, block_size: int) -> None:
    for offset in range(block_size):
        if (src, offset) in source:
            target[dst, offset] = source[src, offset]
        else:
            target.pop((dst, offset), None)


def make_config(**kwargs) -> EngineConfig:
    defaults = dict(max_model_len=64, block_size=4, max_num_batched_tokens=32, eos_token_ids=[2])
    return EngineConfig(**{**defaults, **kwargs})


def make_engine(
    num_blocks: int = 64,
    script=None,
    sample=None,
    kv_cache_groups=(None,),
    num_host_blocks: int = 0,
    costs: tuple[float, float] = (0.0, 0.0),
    **config_kwargs,
):
    """An EngineCore over a StandInExecutor that checks its blocks against the engine's;
    `kv_cache_groups` are the sliding windows (None: full attention) the workers report;
    `costs` the (block copy, prefill token) seconds they measured."""
    executor = StandInExecutor(num_blocks, script or {}, sample)
    executor.kv_cache_groups = tuple(kv_cache_groups)
    executor.num_host_blocks = num_host_blocks
    executor.costs = costs
    engine = EngineCore(make_config(**config_kwargs), executor)
    executor.kv_cache_manager = engine.kv_cache_manager
    executor.max_model_len = engine.config.max_model_len
    executor.num_speculative_tokens = engine.config.num_speculative_tokens
    executor.schedules_ahead = engine.max_in_flight > 0
    return engine, executor


def make_request(
    request_id: str,
    prompt: list[int] | int,
    arrival_time: float = 0.0,
    priority: int = 0,
    **sampling,
) -> EngineCoreRequest:
    """`prompt` is the token ids, or a length (consecutive ids from a base unique to the id)."""
    if isinstance(prompt, int):
        base = 1000 * (1 + zlib.crc32(request_id.encode()) % 10**6)
        prompt = [base + i for i in range(prompt)]
    sampling = {"max_tokens": 8, **sampling}
    return EngineCoreRequest(request_id, prompt, SamplingParams(**sampling), arrival_time, priority)


def run_to_completion(engine: EngineCore, max_steps: int = 1000) -> dict[str, list]:
    """Step until idle; returns per request its token ids and finish reason."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return results
        collect(engine.step(), results)
    raise AssertionError("engine did not finish")


def collect(outputs: EngineCoreOutputs, results: dict[str, list]) -> None:
    for out in outputs.outputs:
        tokens, reason = results.setdefault(out.request_id, [[], None])
        assert reason is None, f"output for {out.request_id} after it finished"
        tokens.extend(out.new_token_ids)
        reason = out.finish_reason
        results[out.request_id][1] = None if reason is None else str(reason)


def pull_params(prompt: list[int], **overrides) -> KVTransferParams:
    """A consumer request's kv_transfer_params: pull `prompt`'s KV from a producer (these
    workers only read the block ids; the rest is what a producer would answer)."""
    fields = dict(
        do_remote_prefill=True,
        remote_engine_id="producer",
        remote_block_ids=[[11, 12, 13, 14, 15]],
        remote_host="10.0.0.7",
        remote_port=20000,
        remote_tp_size=1,
        transfer_id="t1",
        transfer_key="secret",
        prompt_hash=prompt_hash(prompt),
        expires=time.time() + 60,
    )
    return KVTransferParams(**{**fields, **overrides})
