"""A GGUF file's converted config/tokenizer folder: contents, cache key, atomic reuse."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ipc.tokenizer import Tokenizer
from models import gguf_folder
from models.gguf_folder import gguf_hf_folder
from tests.models.tiny_gguf import BOS_ID, EOS_ID, IM_START_ID, write_tiny_gguf


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "splitserve" / "gguf"


def test_folder_holds_config_generation_config_and_tokenizer(cache, tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "qwen3")
    folder = Path(gguf_hf_folder(path))
    assert folder.name == "tiny-qwen3" and folder.parent.parent == cache
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["max_position_embeddings"], config["vocab_size"]) == (512, 260)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (BOS_ID, [EOS_ID])
    tokenizer = Tokenizer.from_pretrained(str(folder))
    assert tokenizer.encode("hello") == [259, 108, 108, 111]
    chat = tokenizer.encode_chat([{"role": "user", "content": "hi"}], True)
    assert chat[0] == IM_START_ID and chat[-11:] == [IM_START_ID, *b"assistant\n"]


def test_end_of_turn_token_stops_too(cache, tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "llama", eot_id=IM_START_ID)
    generation = json.loads((Path(gguf_hf_folder(path)) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [EOS_ID, IM_START_ID]


def test_converted_once_and_again_when_the_file_changes(cache, tmp_path, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path, "llama")
    first = gguf_hf_folder(path)

    def no_conversion(gguf, out):
        raise AssertionError("converted again")

    with monkeypatch.context() as m:
        m.setattr(gguf_folder, "_convert", no_conversion)
        assert gguf_hf_folder(path) == first
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = gguf_hf_folder(path)
    assert second != first and Path(second).name == Path(first).name
    assert [p.name for p in cache.iterdir()] == [Path(second).parent.name]  # the stale one went


def test_folders_of_deleted_files_go_when_another_converts(cache, tmp_path):
    for name in ("kept", "deleted", "third"):
        (tmp_path / name).mkdir()
    kept, _ = write_tiny_gguf(tmp_path / "kept", "llama")
    deleted, _ = write_tiny_gguf(tmp_path / "deleted", "llama")
    folders = [Path(gguf_hf_folder(p)).parent for p in (kept, deleted)]
    unrecorded = cache / "0123456789abcdef"  # an older folder, which says nothing of its file
    unrecorded.mkdir()
    deleted.unlink()
    assert gguf_hf_folder(kept) == str(folders[0] / kept.stem)  # nothing converted: none go
    assert folders[1].exists()
    third, _ = write_tiny_gguf(tmp_path / "third", "qwen3")
    newest = Path(gguf_hf_folder(third)).parent
    assert sorted(cache.iterdir()) == sorted([folders[0], newest, unrecorded])


def test_failed_conversion_leaves_nothing(cache, tmp_path, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path, "llama")

    def crash(gguf, out):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(gguf_folder, "_convert", crash)
    with pytest.raises(RuntimeError, match="boom"):
        gguf_hf_folder(path)
    assert list(cache.iterdir()) == []


def test_missing_file_is_named(cache, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        gguf_hf_folder(tmp_path / "nothing.gguf")
