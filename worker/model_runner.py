import logging
import math
import os
import time
from collections import deque
from dataclasses import replace

import numpy as np
import torch

from attention import get_attn_backend, kv_cache_torch_dtype, set_forward_context
from ipc.config import EngineConfig, resolve_quantization
from ipc.messages import ModelRunnerOutput, SchedulerOutput
from ipc.utils import cdiv
from kernels import KernelSet
from kernels.huge_pages import zeros_on_huge_pages
from models import kv_cache_shape_info, load_config, load_model, resolve_dtype
from models.parallel_state import get_tp_rank, get_tp_size, set_expert_parallel, tp_broadcast
from worker.batch_update import update_batch
from worker.buffers import InputBuffers
from worker.cuda_graph import CudaGraphRunner, Mode, capture_sizes, cuda_graphs_off_reason
from worker.draft_model import DraftModel
from worker.grammar_bitmask import apply_grammar_bitmask
from worker.host_pages import FaultInBehind
from worker.input_batch import CachedRequestState, InputBatch
from worker.kv_cache_groups import group_layers, group_size
from worker.kv_connector import KVConnectorWorker, make_kv_connector
from worker.kv_offload import HostKVCache, measure_block_copy_seconds
from worker.prompt_logprobs import compute_prompt_logprobs, plan_prompt_logprobs
from worker.sampler import Sampler
from worker.step_inputs import PendingSamples, StepInputs, prepare_inputs
from worker.step_output import DraftVerification, LaunchedStep, finish_step

_CPU_KV_CACHE_BYTES = 4 << 30
_CPU_TIMED_PREFILL_TOKENS = 256
logger = logging.getLogger(__name__)


class ModelRunner:
    """Holds this rank's model shard, KV cache and persistent batch; runs one step.

    A step: update the persistent batch from the SchedulerOutput, build the inputs
    on the host with numpy in persistent buffers, copy them to the device once, run the
    forward pass under the step's attention metadata (or replay a captured decode graph),
    sample the requests whose known tokens are all computed (a partial prefill chunk
    samples nothing), and append the sampled tokens to their rows so the next step can
    read them without the EngineCore.

    Setup, in order: `determine_num_blocks()` (and `determine_num_host_blocks()`),
    `initialize_kv_cache(num_blocks, num_host_blocks)`, `capture_cuda_graphs()`.
    `separate_device_arena` runs the step inputs' host-to-device copy on CPU too (tests).
    """

    def __init__(
        self,
        config: EngineConfig,
        device: str | torch.device | None = None,
        *,
        separate_device_arena: bool = False,
    ) -> None:
        self.config = config
        self.device = torch.device(device or _default_device(config.device))
        self.hf_config = load_config(config.hf_config_path or config.model)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, device=self.device)
        # Chosen once, from the environment; every kernel the model uses is built now, before
        # READY (the quantized-weight ones only for a quantized model).
        self.kernels = KernelSet.for_device(self.device)
        self.kernels.build(resolve_quantization(config.model, config.quantization) is not None)
        set_expert_parallel(config.enable_expert_parallel)
        self.model = load_model(
            config.model,
            config.dtype,
            self.device,
            self.hf_config,
            kernels=self.kernels,
            quantization=config.quantization,
        )
        self.num_layers, self.num_kv_heads, self.head_dim = kv_cache_shape_info(
            self.hf_config, get_tp_size()
        )
        self.attn_backend = get_attn_backend(
            config.attention_backend,
            self.device,
            block_size=config.block_size,
            dtype=self.dtype,
            kernels=self.kernels,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        for layer in self.model.attention_layers():
            layer.spec = replace(layer.spec, kv_cache_dtype=config.kv_cache_dtype)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_num_tokens = config.token_budget(self.device.type)
        self.kv_cache_groups = group_layers(
            [layer.spec.sliding_window for layer in self.model.attention_layers()]
        )
        max_num_blocks_per_req = cdiv(config.max_model_len, config.block_size)
        # A request verifying k drafts samples at k + 1 positions, each a logits row.
        self.max_num_logits = min(
            config.max_num_seqs * (1 + config.num_speculative_tokens),
            max(config.max_num_seqs, self.max_num_tokens),
        )
        self.inputs = InputBuffers(
            config.max_num_seqs,
            self.max_num_tokens,
            max_num_blocks_per_req,
            self.device,
            len(self.kv_cache_groups),
            max_num_logits=self.max_num_logits,
            separate_device_arena=separate_device_arena,
        )
        self.input_batch = InputBatch(
            max_num_reqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            max_num_blocks_per_req=max_num_blocks_per_req,
            block_size=config.block_size,
            device=self.device,
            vocab_size=config.vocab_size,
            eos_token_ids=config.eos_token_ids or [],
            num_kv_cache_groups=len(self.kv_cache_groups),
            staging=self.inputs.batch_staging,
        )
        generator = torch.Generator(self.device).manual_seed(config.seed)
        self.drafter = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftModel(
                spec.model,
                spec.num_speculative_tokens,
                self.hf_config.vocab_size,
                self.kv_cache_groups,
                self.attn_backend,
                dtype=self.dtype,
                device=self.device,
                kernels=self.kernels,
                kv_cache_dtype=config.kv_cache_dtype,
                max_model_len=config.max_model_len,
                generator=generator,
            )
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler(generator, self.kernels)
        self.is_driver = get_tp_rank() == 0
        self.cuda_graphs: CudaGraphRunner | None = None
        self._unfinished: deque[LaunchedStep] = deque()  # launched, in order
        # Pinned host memory the samples of the last two launched steps are copied into.
        self._host_samples = [
            torch.zeros(self.max_num_logits, dtype=torch.long, pin_memory=True)
            for _ in range(2 if self.device.type == "cuda" else 0)
        ]
        self._num_launched = 0
        self.host_kv_cache: HostKVCache | None = None
        self.kv_connector: KVConnectorWorker | None = None
        self.kv_fault_in = FaultInBehind([], at_start=True)  # initialize_kv_cache's replaces it
        # Measured by determine_num_blocks when the host tier is on (else 0): seconds to
        # copy one block one way between the tiers, and to prefill one token.
        self.block_copy_seconds = 0.0
        self.prefill_token_seconds = 0.0

    def kv_cache_bytes_per_block(self) -> int:
        """A block id addresses one page in each of the cache's group_size tensors (and
        in each of the draft model's layers)."""
        elem = self.kv_cache_dtype.itemsize
        num_tensors = group_size(self.kv_cache_groups)
        size = 2 * num_tensors * self.block_size * self.num_kv_heads * self.head_dim * elem
        if self.drafter is not None:
            size += self.drafter.kv_cache_bytes_per_block(self.block_size, self.kv_cache_dtype)
        return size

    def determine_num_blocks(self) -> int:
        """Blocks that fit this rank: `--kv-cache-memory` bytes when given; else on CUDA,
        what a profiling forward at max_num_batched_tokens leaves of the memory budget
        (several engines can then share one GPU), and 4 GiB on CPU. With a host tier, also
        measures block_copy_seconds and prefill_token_seconds."""
        profiled_seconds_per_token = None
        if self.config.num_gpu_blocks_override is not None:
            num_blocks = self.config.num_gpu_blocks_override
        else:
            if self.device.type == "cuda":
                budget, profiled_seconds_per_token = self._profile_cuda_memory()
                budget = self.config.kv_cache_memory or budget
            else:
                budget = self.config.kv_cache_memory or _CPU_KV_CACHE_BYTES
            num_blocks = int(budget // self.kv_cache_bytes_per_block())
            if num_blocks < 2:
                raise RuntimeError(
                    f"no room for the KV cache: {budget / 2**20:.0f} MiB available, "
                    f"{self.kv_cache_bytes_per_block() / 2**20:.2f} MiB per block"
                )
        if self.config.kv_offload_memory > 0:
            self._measure_offload_costs(profiled_seconds_per_token)
        return num_blocks

    def determine_num_host_blocks(self) -> int:
        """Blocks of the host tier that fit `--kv-offload-memory` (0 when it is off)."""
        return self.config.kv_offload_memory // self.kv_cache_bytes_per_block()

    def _measure_offload_costs(self, profiled_seconds_per_token: float | None) -> None:
        """On CUDA the profiling forward gives the prefill cost; elsewhere (or when the
        block count was given, so nothing was profiled) one forward without KV is timed."""
        page_shape = (self.block_size, self.num_kv_heads, self.head_dim)
        num_tensors = group_size(self.kv_cache_groups)
        self.block_copy_seconds = measure_block_copy_seconds(
            num_tensors, page_shape, self.kv_cache_dtype, self.device
        )
        if self.drafter is not None:  # its pages travel too: scaled by bytes
            target_bytes = 2 * num_tensors * math.prod(page_shape) * self.kv_cache_dtype.itemsize
            self.block_copy_seconds *= self.kv_cache_bytes_per_block() / target_bytes
        per_token = profiled_seconds_per_token
        if per_token is None:
            num_tokens = min(_CPU_TIMED_PREFILL_TOKENS, self.max_num_tokens)
            per_token = self._profile_forward(num_tokens)[1] / num_tokens
        self.prefill_token_seconds = per_token

    def _profile_forward(self, num_tokens: int) -> tuple[torch.Tensor, float]:
        """A forward of num_tokens tokens as one sequence, without KV, and its logits for
        the last max_num_seqs: the hidden states and the seconds it took."""
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        with torch.inference_mode(), set_forward_context(None):
            hidden = self.model(input_ids, positions)
            self.model.compute_logits(hidden[-self.config.max_num_seqs :])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return hidden, time.perf_counter() - start

    def _profile_cuda_memory(self) -> tuple[int, float]:
        """The KV cache's memory budget, and the profiling forward's seconds per token.

        gpu_memory_utilization is this instance's share, as in vLLM: what other processes
        hold on the GPU is not charged to it, so two engines at 0.45 share one GPU. The
        share is taken of the process's memory fraction where the host program capped it
        (torch.cuda.set_per_process_memory_fraction), and never exceeds what is free."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden, seconds = self._profile_forward(self.max_num_tokens)
        peak = torch.cuda.max_memory_allocated(self.device)
        current = torch.cuda.memory_allocated(self.device)
        del hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        share = total * torch.cuda.get_per_process_memory_fraction(self.device)
        held = torch.cuda.memory_reserved(self.device)
        budget = share * self.config.gpu_memory_utilization - held - (peak - current)
        return int(min(budget, free - (peak - current))), seconds / self.max_num_tokens

    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """One tensor per position within a group: group g's j-th layer uses tensor j.
        With num_host_blocks, the host tier mirrors those tensors (kv_offload.py)."""
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

        def zeros(shape: tuple[int, ...]) -> torch.Tensor:
            if self.device.type == "cpu":
                return zeros_on_huge_pages(shape, self.kv_cache_dtype)
            return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

        tensors = [zeros(shape) for _ in range(group_size(self.kv_cache_groups))]
        fault_in = os.environ.get("SPLITSERVE_KV_FAULT_IN", "behind")
        if fault_in not in ("behind", "start"):
            raise ValueError(f"SPLITSERVE_KV_FAULT_IN={fault_in!r}: 'behind' or 'start'")
        cpu_tensors = tensors if self.device.type == "cpu" else []
        self.kv_fault_in = FaultInBehind(cpu_tensors, at_start=fault_in == "start")
        layers = self.model.attention_layers()
        for index, group in enumerate(self.kv_cache_groups):
            for tensor, layer in zip(tensors, group.layers, strict=False):
                layers[layer].kv_cache = tensor
                layers[layer].kv_cache_group = index
        logger.info(
            "rank %d: KV cache of %d blocks x %d tokens (%.2f GiB, %s) in %d group(s): %s",
            get_tp_rank(),
            num_blocks,
            self.block_size,
            num_blocks * self.kv_cache_bytes_per_block() / 2**30,
            self.kv_cache_dtype,
            len(self.kv_cache_groups),
            ", ".join(
                f"{len(g.layers)} layer(s) "
                + ("full" if g.sliding_window is None else f"window {g.sliding_window}")
                for g in self.kv_cache_groups
            ),
        )
        if self.drafter is not None:
            draft_shape = self.drafter.kv_cache_shape(num_blocks, self.block_size)
            draft_tensors = [zeros(draft_shape) for _ in range(self.drafter.num_layers)]
            self.drafter.bind_kv_cache(draft_tensors)
            tensors = tensors + draft_tensors
        if self.kv_connector is None:
            self.kv_connector = make_kv_connector(self.config, self.device)
            if self.kv_connector is not None:
                self.kv_connector.register_kv_caches(tensors)
        self.host_kv_cache = None
        if num_host_blocks > 0:
            self.host_kv_cache = HostKVCache(tensors, num_host_blocks)
            logger.info(
                "rank %d: KV host tier of %d blocks (%.2f GiB%s)",
                get_tp_rank(),
                num_host_blocks,
                num_host_blocks * self.kv_cache_bytes_per_block() / 2**30,
                ", pinned" if self.device.type == "cuda" else "",
            )

    def capture_cuda_graphs(self, mode: Mode = "cuda_graph") -> None:
        """Capture the decode CUDA graphs, once the KV cache is bound. Off CUDA, under
        enforce_eager or with a backend that cannot be captured, every step runs eagerly.
        Mode "padded_eager" pads decode steps as the graphs would but runs them eagerly,
        on any device and backend (tests)."""
        if any(layer.kv_cache is None for layer in self.model.attention_layers()):
            raise RuntimeError("initialize_kv_cache must come before capture_cuda_graphs")
        if mode == "cuda_graph":
            reason = cuda_graphs_off_reason(
                self.device, self.config.enforce_eager, self.attn_backend
            )
            if reason is None and self.drafter is not None:
                reason = "a draft model runs beside the target with the step's metadata"
            if reason is not None:
                if self.device.type == "cuda":
                    logger.info("CUDA graphs off: %s", reason)
                return
        config = self.config
        self.cuda_graphs = CudaGraphRunner(
            self.model,
            self.attn_backend,
            self.inputs,
            [table.get_device_tensor() for table in self.input_batch.block_table.groups],
            capture_sizes(config.cuda_graph_sizes, config.max_num_seqs, self.max_num_tokens),
            max_model_len=self.max_model_len,
            hidden_size=self.hf_config.hidden_size,
            dtype=self.dtype,
            mode=mode,
        )
        self.cuda_graphs.capture()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and answer it."""
        return self.finish(self.launch(scheduler_output))

    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Update the batch, queue the step's forward and sampling on the device and start
        its samples' copy to the host; `finish` answers it. While the last launched step
        is unfinished, its samples feed this step's decode rows on the device, so the host
        prepares this step while the device still runs that one; unless a row's sampling
        reads the tokens so far (min_tokens, penalties, bad words): that step is finished
        first."""
        with self.kv_fault_in.held_off():
            return self._launch(scheduler_output)

    @torch.inference_mode()
    def _launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        # The host sides of the batch and the buffers are rewritten from here on.
        self.inputs.wait_for_copies()
        so = scheduler_output
        self._copy_blocks(so)
        connector = self.kv_connector
        if connector is not None:
            connector.start_load_kv(so.kv_connector_metadata)
        failed = update_batch(self.input_batch, self.requests, so, self.device)
        batch = self.input_batch
        pending = None
        if len(self._unfinished) > 1:  # its samples' host buffer is this step's
            self.finish(self._unfinished[0])
        if self._unfinished:
            # A step that verified drafts gives a row several tokens, known on the host only.
            if batch.samples_read_tokens or self._unfinished[-1].verification is not None:
                self.finish(self._unfinished[-1])
            else:
                last = self._unfinished[-1]
                pending = PendingSamples(last.samples_by_request(), last.sampled)
        if batch.num_reqs == 0:
            launched = LaunchedStep.launch(
                so.step_id, batch, _NO_ROWS, _NO_SAMPLES, None, {}, failed
            )
            if connector is not None:  # a step only for transfers: give them a moment
                launched.kv_connector_output = connector.get_finished(_TRANSFER_WAIT_S)
            self._unfinished.append(launched)
            return launched
        step = prepare_inputs(
            batch,
            so.num_scheduled_tokens,
            self.inputs,
            self.attn_backend,
            self.cuda_graphs,
            samples=self.is_driver,
            pending=pending,
        )
        if step.graph_size is not None:
            hidden = self.cuda_graphs.run(step.graph_size)
        else:
            with set_forward_context(step.attn_metadata, self.attn_backend):
                hidden = self.model(step.input_ids, step.positions)
        logits = self.model.compute_logits(hidden[step.logits_indices])
        prompt_logprobs = self._prompt_logprobs(hidden) if batch.num_prompt_logprobs else {}
        if so.structured_output_request_ids and self.is_driver:
            ids, bitmask = so.structured_output_request_ids, so.grammar_bitmask
            apply_grammar_bitmask(
                logits,
                ids,
                bitmask,
                batch.req_ids,
                step.logits_rows,
                so.scheduled_spec_decode_tokens,
            )
        verification = None
        if step.num_logits is not None:
            verification = self._verification(step, so.scheduled_spec_decode_tokens)
            if self.drafter is not None and step.sampling_metadata is not None:
                step.sampling_metadata = replace(
                    step.sampling_metadata,
                    draft_probs=self.drafter.verification_probs(
                        self.input_batch, step, so.scheduled_spec_decode_tokens
                    ),
                )
        sampled, logprobs = self._sample(logits, step)
        host_buffer = None
        if self._host_samples:
            host_buffer = self._host_samples[self._num_launched % 2]
            self._num_launched += 1
        launched = LaunchedStep.launch(
            so.step_id,
            batch,
            step.sample_rows,
            sampled,
            logprobs,
            prompt_logprobs,
            failed,
            host_buffer,
            verification,
            step.logits_rows,
        )
        launched.propose_drafts = so.propose_drafts and self.drafter is not None
        if connector is not None:
            connector.wait_for_save()
            launched.kv_connector_output = connector.get_finished()
        self._unfinished.append(launched)
        return launched

    def _verification(
        self, step: StepInputs, scheduled_drafts: dict[str, list[int]]
    ) -> DraftVerification:
        """The drafts of the step's sample rows and, where the step draws, the seeded
        rows' generator states before it."""
        batch = self.input_batch
        drafts = [scheduled_drafts.get(batch.req_ids[row], []) for row in step.sample_rows]
        states = {}
        metadata = step.sampling_metadata
        if metadata is not None and not metadata.all_greedy and batch.generators:
            for i, row in enumerate(step.sample_rows.tolist()):
                generator = batch.generators.get(row)
                if generator is not None and drafts[i]:
                    states[i] = (generator, generator.get_state())
        return DraftVerification(step.num_logits, drafts, states)

    def finish(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Answer `step`, and first every step launched before it: wait for the samples,
        append them to their requests and report them."""
        while step.output is None:
            oldest = self._unfinished.popleft()
            oldest.output = finish_step(self.input_batch, self.requests, oldest)
            oldest.output.kv_connector_output = oldest.kv_connector_output
            # Drafts follow the batch as this step left it: no later step may have launched.
            if oldest.propose_drafts and not self._unfinished:
                sampled = oldest.output.sampled_token_ids
                req_ids = [r for r, tokens in zip(oldest.req_ids, sampled, strict=True) if tokens]
                oldest.output.draft_token_ids = self.drafter.propose(
                    self.input_batch, self.requests, req_ids
                )
        return step.output

    def _copy_blocks(self, so: SchedulerOutput) -> None:
        """The step's copies between the tiers, before its forward reads the blocks."""
        if not (so.blocks_to_swap_out or so.blocks_to_swap_in):
            return
        if self.host_kv_cache is None:
            raise RuntimeError(
                f"step {so.step_id} copies KV blocks between the device and the host tier, "
                "but this worker has no host tier (kv_offload_memory 0 or no host blocks "
                "in InitKVCache)"
            )
        self.host_kv_cache.copy_blocks(so.blocks_to_swap_out, so.blocks_to_swap_in)

    def _prompt_logprobs(self, hidden: torch.Tensor):
        num_reqs = self.input_batch.num_reqs
        plan = plan_prompt_logprobs(
            self.input_batch,
            self.inputs.query_start_loc.np[: num_reqs + 1],
            self.inputs.seq_lens.np[:num_reqs],
        )
        if plan is None:
            return {}
        return compute_prompt_logprobs(
            self.model.compute_logits, hidden, plan, self.input_batch.vocab_size, self.is_driver
        )

    def _sample(self, logits: torch.Tensor, step: StepInputs):
        """Rank 0 samples (by the settings prepare_inputs staged) and broadcasts the token
        ids, so every rank appends the same tokens to its batch."""
        if len(step.sample_rows) == 0:
            return _NO_SAMPLES, None
        logprobs = None
        if self.is_driver:
            out = self.sampler(logits, step.sampling_metadata)
            sampled, logprobs = out.sampled_token_ids, out.logprobs
        else:
            sampled = torch.empty(logits.shape[0], dtype=torch.long, device=self.device)
        if get_tp_size() > 1:
            tp_broadcast(sampled, src=0)
        return sampled, logprobs


# A step with no tokens runs only to report transfers: it waits this long for one to end.
_TRANSFER_WAIT_S = 0.01
_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_SAMPLES = torch.zeros(0, dtype=torch.long)


def _default_device(name: str) -> str:
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"
