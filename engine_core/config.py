"""EngineConfig: every setting of the engine, validated once, read from a model folder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS = 8192

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_POLICIES = ("fcfs", "priority")
_ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch")
_DEVICES = ("auto", "cpu", "cuda")


@dataclass
class EngineConfig:
    """Settings of one engine. `model` is a local Hugging Face folder; without one (tests),
    `max_model_len` must be given. Fields left None are read from the folder's config.json
    and generation_config.json: max_model_len (max_position_embeddings), eos_token_ids and
    vocab_size. `kv_cache_memory` None leaves the KV cache size to the worker: what
    `gpu_memory_utilization` allows on GPU, a fixed default on CPU.

    On CUDA, pure-decode steps replay CUDA graphs captured for the decode batch sizes
    `cuda_graph_sizes` (None: 1, 2, 4 and multiples of 8 up to the largest decode
    batch, at most 512); `enforce_eager` runs every step eagerly instead (vLLM's
    --enforce-eager).

    Resilience: a worker that dies, reports an error or does not answer a step within
    `worker_step_timeout` seconds is replaced (all workers, a new process group) and the
    running requests are replayed, at most `max_worker_restarts` times within
    `worker_restart_window` seconds. On SIGTERM the EngineCore process stops admitting
    and finishes what runs for up to `shutdown_timeout` seconds."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"
    seed: int = 0
    device: str = "auto"
    eos_token_ids: list[int] | None = None
    vocab_size: int | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    worker_step_timeout: float = 300.0
    max_worker_restarts: int = 3
    worker_restart_window: float = 300.0
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.model is not None:
            self._read_model_folder(Path(self.model))
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.max_model_len is None:
            raise ValueError(
                "max_model_len must be given: there is no model folder, or its config.json "
                "has no max_position_embeddings"
            )
        if self.eos_token_ids is None:
            self.eos_token_ids = []
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS
                if self.enable_chunked_prefill
                else self.max_model_len
            )
        self._validate()

    def _read_model_folder(self, folder: Path) -> None:
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ValueError(f"model must be a local model folder with a config.json: {folder}")
        hf_config = _read_json(config_path)
        max_positions = hf_config.get("max_position_embeddings")
        if self.max_model_len is None:
            self.max_model_len = max_positions
        elif max_positions is not None and self.max_model_len > max_positions:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be <= the model's "
                f"max_position_embeddings ({max_positions})"
            )
        if self.vocab_size is None:
            self.vocab_size = hf_config.get("vocab_size")
        if self.eos_token_ids is None:
            generation = _read_json(folder / "generation_config.json")
            eos = _as_list(hf_config.get("eos_token_id")) + _as_list(generation.get("eos_token_id"))
            self.eos_token_ids = list(dict.fromkeys(eos))

    def _validate(self) -> None:
        _check_choice("dtype", self.dtype, _DTYPES)
        _check_choice("scheduling_policy", self.scheduling_policy, _POLICIES)
        _check_choice("attention_backend", self.attention_backend, _ATTENTION_BACKENDS)
        _check_choice("device", self.device, _DEVICES)
        _check_at_least("max_model_len", self.max_model_len, 2)
        _check_at_least("block_size", self.block_size, 1)
        _check_at_least("max_num_seqs", self.max_num_seqs, 1)
        _check_at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.kv_cache_memory is not None:
            _check_at_least("kv_cache_memory", self.kv_cache_memory, 1)
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


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
