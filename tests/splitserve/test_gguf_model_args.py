"""A .gguf model path where a model folder goes: launch.py's flags, LLM, EngineConfig,
the worker's config and dtype (the weights themselves are not loaded here)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import splitserve.llm as llm_module
from ipc.config import EngineConfig
from launch import parse_args
from models import load_config, resolve_dtype
from splitserve.engine_args import engine_config, make_engine_config
from tests.models.tiny_gguf import EOS_ID, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("gguf"), "llama")
    return path


@pytest.fixture(autouse=True, scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


def test_launch_takes_a_gguf_file_as_the_model(tiny_gguf):
    config = engine_config(parse_args([str(tiny_gguf), "--no-api"]))
    assert config.model == str(tiny_gguf)
    assert Path(config.hf_config_path).name == "tiny-llama"
    assert config.tokenizer == config.hf_config_path
    assert (config.max_model_len, config.vocab_size, config.eos_token_ids) == (512, 260, [EOS_ID])


def test_a_given_tokenizer_and_max_model_len_are_kept(tiny_gguf, tmp_path):
    args = parse_args(["--model", str(tiny_gguf), "--tokenizer", "tok", "--max-model-len", "64"])
    config = engine_config(args)
    assert (config.tokenizer, config.max_model_len) == ("tok", 64)


def test_the_config_crosses_processes_without_converting_again(tiny_gguf, monkeypatch):
    config = make_engine_config(model=str(tiny_gguf))
    monkeypatch.setattr("models.gguf_folder._convert", None)  # any conversion would fail
    crossed = EngineConfig(**json.loads(json.dumps(dataclasses.asdict(config))))
    assert crossed == config
    assert make_engine_config(**dataclasses.asdict(config)) == config


def test_engine_config_alone_says_what_a_gguf_needs(tiny_gguf):
    with pytest.raises(ValueError, match=r"hf_config_path.*make_engine_config"):
        EngineConfig(model=str(tiny_gguf))


def test_worker_config_and_dtype_from_the_file(tiny_gguf):
    config = load_config(str(tiny_gguf))
    assert config.architectures == ["LlamaForCausalLM"]
    float32_checkpoint = SimpleNamespace(dtype="float32")
    assert resolve_dtype("auto", config) == resolve_dtype("auto", float32_checkpoint)


def test_llm_finds_config_and_tokenizer(tiny_gguf, monkeypatch):
    monkeypatch.setattr(llm_module, "_make_executor", lambda config: None)
    monkeypatch.setattr(llm_module, "EngineCore", lambda config, executor: None)
    llm = llm_module.LLM(model=str(tiny_gguf), max_model_len=128)
    assert (llm.config.model, llm.config.max_model_len) == (str(tiny_gguf), 128)
    assert llm.get_tokenizer().encode("hello") == [259, 108, 108, 111]
