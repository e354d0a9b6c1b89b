"""EngineConfig: every setting of the engine, validated once, read from a model folder.

It crosses the process boundary (as JSON on the children's command lines), so the
EngineCore and the workers both import it from here. Each user option is declared once,
as a field whose metadata carries its help text (and its choices, flag names or parser):
`splitserve.engine_args` makes the command line from the fields.
"""

from __future__ import annotations

import argparse
import enum
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ipc.defaults import defaults_from_generation_config
from ipc.kv_transfer import KVTransferConfig, parse_kv_transfer_config
from ipc.spec_config import SpeculativeConfig, parse_speculative_config

# A step's token budget with chunked prefill when none is given, by the workers' device.
# On CPU, steps of 2048 tokens beat 8192 offline (SmolLM2, 128 requests: about +10 % output
# tok/s) and served (vLLM's bench client: time to first token 2.6 s -> 1.0 s), as vLLM's
# CPU default for serving; GPUs keep 8192, vLLM's serving default on an H100.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}

DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")


class SchedulingPolicy(str, enum.Enum):
    """Which waiting request runs first; preemption picks its victim the other way round."""

    FCFS = "fcfs"
    PRIORITY = "priority"


SCHEDULING_POLICIES = tuple(policy.value for policy in SchedulingPolicy)


class PreemptionMode(str, enum.Enum):
    """How a preempted request gives back its KV blocks. swap copies them to the host tier
    (--kv-offload-memory) and back; recompute frees them and prefills again; auto picks the
    cheaper by the workers' measured copy and prefill times."""

    AUTO = "auto"
    SWAP = "swap"
    RECOMPUTE = "recompute"


PREEMPTION_MODES = tuple(mode.value for mode in PreemptionMode)
ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "cpu", "torch")
# vLLM's names: fp8 is fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEVICES = ("auto", "cpu", "cuda")
# --quantization values: a checkpoint's own (quantization_config.quant_method, or gguf for
# a .gguf file) and the online methods, which quantize a 16-bit checkpoint at load.
CHECKPOINT_QUANTIZATION = ("awq", "gptq", "compressed-tensors", "fp8", "gguf")
ONLINE_QUANTIZATION = ("fp8", "int8")
QUANTIZATION_METHODS = tuple(dict.fromkeys(CHECKPOINT_QUANTIZATION + ONLINE_QUANTIZATION))

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({f"{u}i": 1024 ** "kmgt".index(u) * 1024 for u in "kmgt"})


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '64M' (decimal), '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4GiB, 512MiB)")
    return int(float(match[1]) * _UNITS[(match[2] or "").lower()])


def option(
    help: str,
    default_text: str | None = None,
    *,
    flags: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    parse: Any = None,
    metavar: str | None = None,
) -> dict[str, Any]:
    """A field's metadata that makes it a command-line option. `default_text` describes a
    None default; `flags` replace the --kebab-case name; `parse` replaces the type."""
    meta = {"help": help, "default_text": default_text, "flags": flags, "choices": choices}
    return {**meta, "parse": parse, "metavar": metavar}


@dataclass
class EngineConfig:
    """Settings of one engine. `model` is a local Hugging Face folder or a .gguf file;
    without one (tests), `max_model_len` must be given. The fields without a command-line
    option are read from the folder's config.json and generation_config.json when left
    None, once: a config that crosses to another process carries them. A .gguf file's
    are read from `hf_config_path`, the folder its metadata converts to (made by
    splitserve.engine_args.make_engine_config), which is also its default tokenizer.

    Resilience: a worker that dies, reports an error or does not answer a step within
    `worker_step_timeout` seconds is replaced (all workers, a new process group) and the
    running requests are replayed, at most `max_worker_restarts` times within
    `worker_restart_window` seconds. On SIGTERM the EngineCore process stops admitting
    and finishes what runs for up to `shutdown_timeout` seconds."""

    model: str | None = field(
        default=None,
        metadata=option("a local Hugging Face model folder or .gguf file", "SmolLM2-135M-Instruct"),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=option(
            "a Hugging Face tokenizer folder",
            "the model folder; for a .gguf file, its tokenizer converted once",
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=option(
            "the weights' and activations' dtype; auto: the checkpoint's (float32 checkpoints "
            "and .gguf files run in bfloat16 where the hardware has it; on CPUs without bf16 "
            "instructions float32 with the dense weights held in bfloat16)",
            choices=DTYPES,
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=option(
            "how the weights are quantized: one of "
            f"{', '.join(QUANTIZATION_METHODS)}; fp8 and int8 also quantize a 16-bit "
            "checkpoint at load (per output channel)",
            "the checkpoint's (its quantization_config, or gguf for a .gguf file)",
            metavar="METHOD",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=option(
            "longest prompt + completion, in tokens", "the model's max_position_embeddings"
        ),
    )
    block_size: int = field(default=16, metadata=option("tokens per KV cache block"))
    kv_cache_dtype: str = field(
        default="auto",
        metadata=option(
            "the KV cache's dtype; auto: the model's. fp8 (= fp8_e4m3) and fp8_e5m2 store "
            "K/V in 8 bits with per-layer scales (1.0, or the checkpoint's k_scale/v_scale): "
            "about twice the blocks in the same memory",
            choices=KV_CACHE_DTYPES,
        ),
    )
    max_num_seqs: int = field(default=256, metadata=option("requests in one step, at most"))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=option(
            "tokens in one step, at most",
            "{cpu} on CPU, {cuda} on CUDA; max-model-len without chunked prefill".format(
                **DEFAULT_MAX_NUM_BATCHED_TOKENS
            ),
        ),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=option("reuse the KV cache blocks of shared prompt prefixes")
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=option("split long prefills over steps, beside decodes")
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=option(
            "worker processes (tensor-parallel ranks)",
            flags=("--tensor-parallel-size", "--tp"),
            metavar="N",
        ),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=option(
            "EngineCores, each with its own tensor-parallel workers, behind the API server(s), "
            "which send each request to the one with the least load (launch.py)",
            flags=("--data-parallel-size", "-dp"),
            metavar="N",
        ),
    )
    # This engine's index among them (set by the launcher): its workers' share of the
    # CPU cores or GPUs.
    data_parallel_rank: int = 0
    distributed_executor_backend: str = field(
        default="mp",
        metadata=option(
            "how launch.py starts the workers: mp, processes on this host; ray, actors "
            "of the Ray cluster of $RAY_ADDRESS (else a local one; needs --engine-host and "
            "`pip install ray`)",
            choices=("mp", "ray"),
        ),
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata=option(
            "MoE models: place whole experts on the ranks instead of slicing every expert "
            "over them (the experts must divide over the ranks)"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=option(
            "this engine's share of each GPU's memory, in (0, 1]; what other processes hold "
            "is not charged to it (vLLM's meaning: two engines at 0.45 share a GPU)"
        ),
    )
    kv_cache_memory: int | None = field(
        default=None,
        metadata=option(
            "KV cache bytes per rank: 4GiB, 512MiB, 64M",
            "what gpu-memory-utilization leaves on GPU, 4GiB on CPU",
            parse=parse_bytes,
            metavar="SIZE",
        ),
    )
    kv_offload_memory: int = field(
        default=0,
        metadata=option(
            "host-memory KV tier per rank (pinned; swapped-out requests and blocks evicted "
            "from the device prefix cache): 8GiB, 512MiB; 0 turns it off. On a CPU device it "
            "is the same memory, so only tests turn it on there",
            parse=parse_bytes,
            metavar="SIZE",
        ),
    )
    preemption_mode: PreemptionMode = field(
        default=PreemptionMode.AUTO,
        metadata=option(
            "swap: to the host tier when it has room; recompute: prefill again; auto: the "
            "cheaper by measured copy and prefill times (recompute without a host tier)",
            choices=PREEMPTION_MODES,
        ),
    )
    num_gpu_blocks_override: int | None = field(
        default=None,
        metadata=option("KV cache blocks, instead of what fits in memory", "what fits"),
    )
    scheduling_policy: SchedulingPolicy = field(
        default=SchedulingPolicy.FCFS,
        metadata=option(
            "fcfs: first come, first served; priority: lowest priority value first",
            choices=SCHEDULING_POLICIES,
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=option(
            "auto: flash_attn (else triton) on CUDA; cpu (C++ kernels, else torch) on CPU",
            choices=ATTENTION_BACKENDS,
        ),
    )
    seed: int = field(
        default=0, metadata=option("seed of the sampling of requests that set no seed")
    )
    device: str = field(
        default="auto", metadata=option("auto: CUDA when there is one", choices=DEVICES)
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata=option(
            "schedule step N+1 while the workers run step N; the workers feed step N's "
            "tokens into it themselves, and stop conditions apply one step late (the extra "
            "token is dropped). Steps with structured-output requests run in lockstep",
            "on with GPU workers and with workers in processes of their own (launch.py, "
            "LLM with tensor_parallel_size > 1), where the steps overlap",
        ),
    )
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata=option(
            'speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or '
            '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}; also '
            "disable_by_batch_size and adaptive (ipc/spec_config.py)",
            "off",
            parse=parse_speculative_config,
            metavar="JSON",
        ),
    )
    kv_transfer_config: KVTransferConfig | None = field(
        default=None,
        metadata=option(
            'prefill/decode disaggregation, as vLLM\'s JSON: {"kv_connector": "ZmqConnector", '
            '"kv_role": "kv_producer" | "kv_consumer" | "kv_both"}; also engine_id, kv_ip, '
            "kv_port and kv_connector_extra_config (credentials, send_timeout_s, "
            "pull_timeout_s; ipc/kv_transfer.py)",
            "off",
            parse=parse_kv_transfer_config,
            metavar="JSON",
        ),
    )
    enforce_eager: bool = field(
        default=False, metadata=option("run every step eagerly: no CUDA graphs")
    )
    cuda_graph_sizes: list[int] | None = field(
        default=None,
        metadata=option(
            "decode batch sizes to capture as CUDA graphs",
            "1, 2, 4 and multiples of 8 up to the largest decode batch, at most 512",
            metavar="SIZE",
        ),
    )
    worker_step_timeout: float = field(
        default=300.0,
        metadata=option("seconds a step may take before its workers are deemed hung"),
    )
    max_worker_restarts: int = field(
        default=3,
        metadata=option(
            "replace failed workers at most this often within --worker-restart-window, "
            "replaying their requests; 0 makes a worker failure fatal"
        ),
    )
    worker_restart_window: float = field(
        default=300.0, metadata=option("seconds over which --max-worker-restarts counts")
    )
    shutdown_timeout: float = field(
        default=30.0, metadata=option("on SIGTERM, seconds to let running requests finish")
    )
    # Read from the model folder (no options).
    hf_config_path: str | None = None
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    eos_token_ids: list[int] | None = None
    sampling_defaults: dict | None = None

    def __post_init__(self) -> None:
        if self.model is not None:
            self._read_model_folder(Path(self.hf_config_path or self.model))
            self.quantization = resolve_quantization(self.model, self.quantization)
        if self.tokenizer is None:
            self.tokenizer = self.hf_config_path or self.model
        if self.max_model_len is None:
            self.max_model_len = self.max_position_embeddings
        if self.max_model_len is None:
            raise ValueError(
                "max_model_len must be given: there is no model folder, or its config.json "
                "has no max_position_embeddings"
            )
        if self.eos_token_ids is None:
            self.eos_token_ids = []
        if self.sampling_defaults is None:
            self.sampling_defaults = {}
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = KVTransferConfig.from_value(self.kv_transfer_config)
        if self.max_num_batched_tokens is None and not self.enable_chunked_prefill:
            self.max_num_batched_tokens = self.max_model_len
        self._validate()

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    def token_budget(self, device_type: str) -> int:
        """max_num_batched_tokens, or when it was not given the default of workers on
        `device_type`. Each side resolves it once it knows the device: a worker for its
        buffers, the EngineCore for its scheduler (for "cuda" only when every rank is)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_MAX_NUM_BATCHED_TOKENS[device_type]

    def _read_model_folder(self, folder: Path) -> None:
        """Fill the fields the folder gives; a config whose fields are all filled (one
        that crossed from another process) reads nothing."""
        unread = (self.max_position_embeddings, self.vocab_size, self.eos_token_ids)
        if None not in unread and self.sampling_defaults is not None:
            return
        config_path = folder / "config.json"
        if folder.suffix == ".gguf":
            raise ValueError(
                f"a .gguf model needs hf_config_path, the folder its metadata converts to "
                f"(splitserve.engine_args.make_engine_config makes it): {folder}"
            )
        if not config_path.is_file():
            raise ValueError(f"model must be a local model folder with a config.json: {folder}")
        hf_config = _read_json(config_path)
        generation = _read_json(folder / "generation_config.json")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = hf_config.get("max_position_embeddings")
        if self.vocab_size is None:
            self.vocab_size = hf_config.get("vocab_size")
        if self.eos_token_ids is None:
            eos = _as_list(hf_config.get("eos_token_id")) + _as_list(generation.get("eos_token_id"))
            self.eos_token_ids = list(dict.fromkeys(eos))
        if self.sampling_defaults is None:
            self.sampling_defaults = defaults_from_generation_config(generation)

    def _validate(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}"
                )
        self.scheduling_policy = SchedulingPolicy(self.scheduling_policy)
        self.preemption_mode = PreemptionMode(self.preemption_mode)
        _check_at_least("max_model_len", self.max_model_len, 2)
        positions = self.max_position_embeddings
        if positions is not None and self.max_model_len > positions:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be <= the model's "
                f"max_position_embeddings ({positions})"
            )
        _check_at_least("block_size", self.block_size, 1)
        _check_at_least("max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_batched_tokens is not None:
            _check_at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_at_least("data_parallel_size", self.data_parallel_size, 1)
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be mp or ray, got "
                f"{self.distributed_executor_backend!r}"
            )
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank ({self.data_parallel_rank}) must be in "
                f"[0, data_parallel_size={self.data_parallel_size})"
            )
        if self.kv_cache_memory is not None:
            _check_at_least("kv_cache_memory", self.kv_cache_memory, 1)
        _check_at_least("kv_offload_memory", self.kv_offload_memory, 0)
        if self.num_gpu_blocks_override is not None:
            _check_at_least("num_gpu_blocks_override", self.num_gpu_blocks_override, 2)
        if self.vocab_size is not None:
            _check_at_least("vocab_size", self.vocab_size, 1)
        if self.cuda_graph_sizes is not None:
            if not self.cuda_graph_sizes:
                raise ValueError("cuda_graph_sizes must not be empty (see enforce_eager)")
            for size in self.cuda_graph_sizes:
                _check_at_least("every cuda_graph_sizes entry", size, 1)
        _check_at_least("max_worker_restarts", self.max_worker_restarts, 0)
        for name in ("worker_step_timeout", "worker_restart_window", "shutdown_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if any(t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be >= 0, got {self.eos_token_ids}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled, or long prompts could "
                "never be scheduled"
            )


def checkpoint_quantization(model: str) -> str | None:
    """The quantization a checkpoint ships with: gguf for a .gguf file, else its
    config.json's quantization_config.quant_method (None: a 16/32-bit checkpoint)."""
    if str(model).endswith(".gguf"):
        return "gguf"
    quant = _read_json(Path(model) / "config.json").get("quantization_config") or {}
    method = quant.get("quant_method")
    return None if method is None else str(method).lower()


def resolve_quantization(model: str, requested: str | None) -> str | None:
    """The method to run `model` with, given --quantization (None: the checkpoint's);
    a clear error where the two disagree or the engine has no such method."""
    detected = checkpoint_quantization(model)
    if detected is not None and detected not in CHECKPOINT_QUANTIZATION:
        raise ValueError(
            f"{model}: checkpoint quantization {detected!r} is not supported (supported: "
            f"{', '.join(CHECKPOINT_QUANTIZATION)})"
        )
    if requested is None:
        return detected
    if requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {requested!r}"
        )
    if detected is None and requested not in ONLINE_QUANTIZATION:
        raise ValueError(
            f"--quantization {requested}: {model} is not a {requested} checkpoint (it has no "
            "quantization_config); only fp8 and int8 quantize a 16-bit checkpoint at load"
        )
    if detected is not None and requested != detected:
        raise ValueError(
            f"--quantization {requested} does not match {model}, a {detected} checkpoint"
        )
    return requested


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
