r"""Requantize a GGUF file to another block type, or keep only some of its layers, once,
with gguf-py.

The default model ships only as Q4_1 (its token embedding as Q8_0); no 16-bit GGUF of it
exists. A Q8_0 file for the benchmarks is made by dequantizing every quantized tensor and
quantizing it again to Q8_0, copying the metadata. Its weights are the Q4_1 model's
(requantized), not an 8-bit quantization of the original checkpoint.

`--layers N` keeps the first N transformer blocks (and the embedding, final norm and
head) as they are; `--layers 0-3,26-29` keeps those blocks, renumbered in order: a
layer-skipping model of the same tokenizer, the draft model of the speculative decoding
benchmark.

    python -m benchmarks.gguf_requantize [--type Q8_0 | --layers SPEC] [--src FILE] [--dst FILE]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import LlamaFileType
from gguf.quants import dequantize, quantize

UNQUANTIZED = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
FILE_TYPES = {"Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0}


def kept_layers(spec: str) -> list[int]:
    """ "N": blocks 0..N-1; "0-3,26-29": those blocks (ranges inclusive), in order."""
    if spec.isdigit():
        return list(range(int(spec)))
    layers = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        layers += range(int(first), int(last or first) + 1)
    return sorted(set(layers))


def requantize(src: Path, dst: Path, qtype: str | None = None, layers: str | None = None) -> Path:
    """Write src with every quantized tensor requantized to qtype (None: as it is; F16/F32
    tensors always as they are), and of its blocks only those `layers` keeps (None: all),
    renumbered in order; the file appears at dst whole or not at all."""
    renumber = None if layers is None else {old: new for new, old in enumerate(kept_layers(layers))}
    target = None if qtype is None else GGMLQuantizationType[qtype]
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    writer = GGUFWriter(tmp, arch)
    skipped = {"general.architecture"} | ({"general.file_type"} if qtype else set())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in skipped:
            continue
        contents = field.contents()
        if renumber is not None and name == f"{arch}.block_count":
            contents = len(renumber)
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, contents, field.types[0], sub_type)
    if qtype is not None:
        writer.add_file_type(FILE_TYPES[qtype])
    for t in reader.tensors:
        name = t.name
        if renumber is not None and name.startswith("blk."):
            _, block, rest = name.split(".", 2)
            if int(block) not in renumber:
                continue
            name = f"blk.{renumber[int(block)]}.{rest}"
        if t.tensor_type in UNQUANTIZED or target is None:
            writer.add_tensor(name, t.data, raw_dtype=t.tensor_type)
        else:
            data = quantize(dequantize(t.data, t.tensor_type), target)
            writer.add_tensor(name, data, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


def requantized_default(qtype: str = "Q8_0") -> Path:
    """The default model's GGUF requantized to qtype, made once in the splitserve cache."""
    from models.default import cache_dir, find_gguf

    src = find_gguf()
    dst = cache_dir() / src.name.replace("Q4_1", f"{qtype}-requantized")
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        requantize(src, dst, qtype)
    return dst


def truncated_default(layers: str) -> Path:
    """The default model's GGUF with only the blocks `layers` keeps, made once in the cache."""
    from models.default import cache_dir, find_gguf

    src = find_gguf()
    dst = cache_dir() / src.name.replace("Q4_1", f"Q4_1-layers-{layers.replace(',', '_')}")
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        requantize(src, dst, layers=layers)
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--type", choices=sorted(FILE_TYPES), help="default Q8_0, unless --layers")
    p.add_argument("--layers", help="keep only these blocks: N (the first N) or 0-3,26-29")
    p.add_argument("--src", type=Path, help="default: the default model's Q4_1 file")
    p.add_argument("--dst", type=Path, help="default: beside the converted default model")
    args = p.parse_args()
    qtype = args.type or (None if args.layers else "Q8_0")
    if args.src is None:
        print(truncated_default(args.layers) if args.layers else requantized_default(qtype))
    else:
        suffix = f".{qtype}" if qtype else ""
        suffix += f".layers-{args.layers.replace(',', '_')}" if args.layers else ""
        dst = args.dst or args.src.with_suffix(f"{suffix}.gguf")
        print(requantize(args.src, dst, qtype, args.layers))


if __name__ == "__main__":
    main()
