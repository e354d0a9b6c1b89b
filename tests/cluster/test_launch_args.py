"""launch.py's command line: vLLM's engine argument names become the EngineConfig, which
reaches the child processes intact as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from launch import build_parser, engine_config, parse_bytes
from tests.models.tiny import make_tiny_checkpoint


@pytest.mark.parametrize(
    ("text", "size"),
    [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("64M", 64_000_000), ("2kib", 2048), ("123", 123)],
)
def test_parse_bytes(text, size):
    assert parse_bytes(text) == size


def test_parse_bytes_refuses_nonsense():
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("4 parsecs")


def test_engine_args_become_the_config(tmp_path):
    model = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False)
    argv = ["--model", model, "--tensor-parallel-size", "2", "--max-model-len", "128"]
    argv += ["--no-enable-prefix-caching", "--kv-cache-memory", "1MiB", "--dtype", "float32"]
    argv += ["--num-gpu-blocks-override", "40", "--scheduling-policy", "priority"]
    config = engine_config(build_parser().parse_args(argv))
    assert (config.tensor_parallel_size, config.max_model_len) == (2, 128)
    assert not config.enable_prefix_caching and config.enable_chunked_prefill
    assert (config.kv_cache_memory, config.num_gpu_blocks_override) == (1 << 20, 40)
    assert (config.dtype, config.scheduling_policy) == ("float32", "priority")
    as_json = json.dumps(dataclasses.asdict(config))
    assert engine_config(build_parser().parse_args(["--config-json", as_json])) == config
