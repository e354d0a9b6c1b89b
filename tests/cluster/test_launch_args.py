"""launch.py's command line: the engine flags are made from EngineConfig's fields, with
vLLM's names, and become the EngineConfig, which reaches the child processes intact as
JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import types
from pathlib import Path

import pytest

from ipc.config import DTYPES, EngineConfig, parse_bytes
from launch import build_parser, main, parse_args
from splitserve import LLM
from splitserve.engine_args import engine_config, engine_options
from splitserve.roles import engine_address, engine_addresses
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


def test_every_engine_option_is_one_flag_with_its_default():
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions}
    for f in engine_options():
        action = flags[f.name]
        assert action.help and "(default: " in action.help, f.name
        assert action.default is None, f.name
    for name in ("eos_token_ids", "vocab_size", "max_position_embeddings", "sampling_defaults"):
        assert name not in flags
    assert {"--tensor-parallel-size", "--tp"} <= set(flags["tensor_parallel_size"].option_strings)
    assert flags["dtype"].choices == DTYPES
    assert "--no-enforce-eager" in flags["enforce_eager"].option_strings


def test_every_launch_flag_has_a_help_line_with_its_default():
    for action in build_parser()._actions:
        if action.help in (None, argparse.SUPPRESS) or action.dest == "help":
            continue
        assert "default" in action.help, action.option_strings


def test_flags_are_typed_by_the_annotations():
    argv = ["--tp", "2", "--enforce-eager", "--cuda-graph-sizes", "1", "2", "8"]
    argv += ["--gpu-memory-utilization", "0.5", "--max-worker-restarts", "0", "--seed", "7"]
    args = build_parser().parse_args(argv)
    assert args.tensor_parallel_size == 2 and args.enforce_eager is True
    assert args.cuda_graph_sizes == [1, 2, 8] and args.gpu_memory_utilization == 0.5
    assert (args.max_worker_restarts, args.seed, args.model) == (0, 7, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dtype", "int8"])


def test_dtype_names_agree_everywhere():
    """The CLI's choices, EngineConfig and models.resolve_dtype accept the same names."""
    import torch

    from models import resolve_dtype

    for name in DTYPES:
        EngineConfig(max_model_len=16, dtype=name)
        assert isinstance(resolve_dtype(name, types.SimpleNamespace()), torch.dtype)
    with pytest.raises(ValueError):
        EngineConfig(max_model_len=16, dtype="bf16")
    with pytest.raises(ValueError):
        resolve_dtype("bf16", types.SimpleNamespace())


def test_a_config_from_json_reads_no_model_folder(tmp_path):
    model = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False)
    config = EngineConfig(model=model)
    assert config.vocab_size and config.max_model_len == config.max_position_embeddings
    as_dict = dataclasses.asdict(config)
    (Path(model) / "config.json").unlink()
    assert EngineConfig(**as_dict) == config


def test_vllm_serve_style_flags_name_the_model_and_the_http_port(tmp_path):
    """As `vllm serve MODEL --host H --port P`: the model positionally, --host/--port for
    the HTTP server; the engine's own tcp address has --engine-host/--engine-port."""
    model = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False)
    args = parse_args([model, "--host", "127.0.0.1", "--port", "9000"])
    assert (args.api_host, args.api_port) == ("127.0.0.1", 9000)
    assert engine_config(args).model == model
    assert engine_address(args).startswith("ipc://")
    args = parse_args(["--model", model, "--engine-host", "127.0.0.1", "--engine-port", "7000"])
    assert engine_address(args) == "tcp://127.0.0.1:7000" and args.api_port == 8000
    assert parse_args(["--api-port", "9001", model, "--model", model]).api_port == 9001
    with pytest.raises(SystemExit):
        parse_args([model, "--model", str(tmp_path)])


def test_data_parallel_flags_give_each_engine_its_own_address(tmp_path):
    """-dp N (vLLM's short flag): on tcp engine i takes the 3 ports from PORT + 3i; else
    each has its own ipc folder. A rank outside the size is refused."""
    model = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False)
    args = parse_args([model, "-dp", "3", "--engine-host", "127.0.0.1", "--engine-port", "7000"])
    assert engine_config(args).data_parallel_size == 3
    assert engine_addresses(args, 3) == [f"tcp://127.0.0.1:{p}" for p in (7000, 7003, 7006)]
    ipc = engine_addresses(parse_args([model, "--data-parallel-size", "2"]), 2)
    assert len({Path(a[len("ipc://") :]).parent for a in ipc}) == 2
    with pytest.raises(ValueError, match="data_parallel_rank"):
        EngineConfig(model=model, data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        EngineConfig(model=model, data_parallel_size=0)


def test_data_parallel_needs_as_many_addresses_and_a_cluster(tmp_path):
    model = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False)
    with pytest.raises(SystemExit, match="names 1 engines but --data-parallel-size is 2"):
        main([model, "-dp", "2", "--engine-address", "ipc:///tmp/x", "--no-api"])
    with pytest.raises(ValueError, match="LLM drives one EngineCore"):
        LLM(model, data_parallel_size=2, max_model_len=64)


def test_socket_paths_too_long_for_a_unix_socket_are_refused_by_name(tmp_path, monkeypatch, capsys):
    """A unix socket's path holds at most 107 bytes: a longer --engine-address, or a TMPDIR
    that makes the default address longer, is refused before anything starts (zmq would
    fail the bind in the engine process)."""
    model = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False)
    long_folder = tmp_path / ("d" * 100)
    long_folder.mkdir()
    with pytest.raises(SystemExit):
        parse_args([model, "--engine-address", f"ipc://{long_folder}/engine"])
    assert "--engine-address: the socket path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([model, "--engine-address", "ipc:///tmp/x,udp://h:1"])
    assert "must start with ipc:// or tcp://" in capsys.readouterr().err
    assert parse_args([model, "--engine-address", "ipc:///tmp/x"]).engine_address
    monkeypatch.setattr(tempfile, "tempdir", str(long_folder))
    with pytest.raises(ValueError, match="longer than the 107 bytes.*set TMPDIR to a shorter"):
        engine_addresses(parse_args([model]), 1)
    assert list(long_folder.iterdir()) == []
