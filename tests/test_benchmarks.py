"""The quantization benchmarks' own logic: the GGUF requantizer, the byte counts and the
tables (no engine, no server)."""

from __future__ import annotations

import argparse
import json

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from benchmarks.compare_llamacpp import table as compare_table
from benchmarks.gguf_requantize import requantize
from benchmarks.quant_bench import common_prefix, kv_bytes_per_token, weight_bytes


def _tiny_gguf(path, weight: np.ndarray) -> None:
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("blk.0.attn_q.weight", quantize(weight, GGMLQuantizationType.Q4_1),
                      raw_dtype=GGMLQuantizationType.Q4_1)  # fmt: skip
    writer.add_tensor("blk.0.attn_norm.weight", np.arange(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_requantize_keeps_metadata_and_values(tmp_path):
    weight = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    src, dst = tmp_path / "m.Q4_1.gguf", tmp_path / "m.Q8_0.gguf"
    _tiny_gguf(src, weight)
    requantize(src, dst, "Q8_0")
    a, b = GGUFReader(src), GGUFReader(dst)
    assert b.fields["llama.block_count"].contents() == 1
    assert b.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert b.fields["general.file_type"].contents() == 7  # MOSTLY_Q8_0
    q, norm = b.tensors
    assert q.tensor_type == GGMLQuantizationType.Q8_0 and list(q.shape) == [64, 8]
    assert norm.tensor_type == GGMLQuantizationType.F32
    np.testing.assert_array_equal(norm.data, np.arange(64, dtype=np.float32))
    q4 = dequantize(a.tensors[0].data, a.tensors[0].tensor_type)
    q8 = dequantize(q.data, q.tensor_type)
    assert np.abs(q8 - q4).max() <= np.abs(q4).max() / 127
    assert not list(tmp_path.glob("*.tmp*"))


def test_weight_and_kv_bytes(tmp_path):
    config = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, head_dim=4)
    config |= dict(num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16  # q, k + v, o, gate + up + down
    params = 2 * per_layer + 10 * 8 + 5 * 8  # layers, tied head, norms
    assert weight_bytes("bf16", str(tmp_path)) == 2 * params
    scales = 4 * 2 * (8 + 4 + 4 + 8 + 16 + 16 + 8)
    assert weight_bytes("int8", str(tmp_path)) == 2 * per_layer + scales + 2 * (10 * 8 + 5 * 8)
    assert kv_bytes_per_token(str(tmp_path), "auto") == 2 * 2 * 1 * 4 * 2
    assert kv_bytes_per_token(str(tmp_path), "fp8") == 2 * 2 * 1 * 4


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2]) == 2
    assert common_prefix([5], [1]) == 0


def test_compare_table_ratios():
    rows = {
        "splitserve": {"decode": 30.0, "c8": 200.0},
        "llama-server": {"decode": 60.0, "c8": 100.0},
    }
    out = compare_table(rows, argparse.Namespace(concurrency=[8]))
    assert "| splitserve / llama-server | 0.50x | 2.00x |" in out.splitlines()
