"""A GGUF file's Hugging Face folder: config.json, generation_config.json and the
tokenizer (its chat template from the metadata), converted once with transformers.

The engine reads its settings and the clients their tokenizer from this folder; the
weights stay in the file. It is cached under the user cache, keyed by the file's path,
size and modification time, and named after the file (the name the server reports):
`$XDG_CACHE_HOME/splitserve/gguf/<key>/<file stem>`, written atomically. Converting one
removes those of files that are gone or changed since.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from models.default import cache_dir, write_folder_atomically
from models.gguf_file import gguf_config, read_gguf

_SOURCE = "source"  # beside the converted folder: the file it came from
# Metadata naming the tokens that end a turn besides eos (llama 3's <|eot_id|>, ...).
_STOP_TOKEN_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_hf_folder(path: str | os.PathLike) -> str:
    """The folder of `path`'s config and tokenizer, converting the file on first use."""
    path = Path(path).resolve()
    target = cache_dir() / "gguf" / _key(path)
    write_folder_atomically(
        target, lambda out: _convert_into(path, out), lambda t: _is_complete(t / path.stem)
    )
    return str(target / path.stem)


def _key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _convert_into(gguf: Path, out: Path) -> None:
    _forget_stale(out.parent)
    _convert(gguf, out / gguf.stem)
    (out / _SOURCE).write_text(str(gguf))


def _forget_stale(cache: Path) -> None:
    """Remove the folders of files that are gone or changed since (their key can never come
    again: a test's or a download's temporary file would otherwise leave one behind per run)."""
    for folder in cache.glob("[!.]*"):
        try:
            source = Path((folder / _SOURCE).read_text())
            if source.is_file() and _key(source) == folder.name:
                continue
        except OSError:  # no record (an older folder, or one being replaced): keep it
            continue
        shutil.rmtree(folder, ignore_errors=True)


def _is_complete(folder: Path) -> bool:
    return (
        (folder / "config.json").is_file()
        and (folder / "generation_config.json").is_file()
        and (folder / "tokenizer_config.json").is_file()
    )


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    config = gguf_config(gguf)
    metadata, _ = read_gguf(gguf)
    stop_ids = [config.eos_token_id] + [metadata.get(key) for key in _STOP_TOKEN_KEYS]
    eos = list(dict.fromkeys(i for i in stop_ids if i is not None))
    generation = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos or None,
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.save_pretrained(str(out))
    generation.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
