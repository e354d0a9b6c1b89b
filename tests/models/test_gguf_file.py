"""GGUF files as models: config, tensor names, llama's q/k rows, against transformers."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from models import gguf_file
from models.gguf_file import gguf_config, hf_name, iterate_gguf
from models.quantization.gguf_types import GGUFWeight
from tests.models.tiny_gguf import HEAD_DIM, write_tiny_gguf


def dequantized(path) -> dict[str, torch.Tensor]:
    return {
        name: value.to_block_quant(name).dequantize() if isinstance(value, GGUFWeight) else value
        for name, value in iterate_gguf(path)
    }


def transformers_state_dict(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.state_dict()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tensors_by_hf_name_in_hf_order(tmp_path, arch):
    path, expected = write_tiny_gguf(tmp_path, arch)
    got = dequantized(path)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name].float(), value), name


def test_quantized_tensors_stay_raw_and_mapped(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "llama")
    tensors = dict(iterate_gguf(path))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, GGUFWeight) and q.ggml_type == "Q8_0" and q.shape == (256, 256)
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    assert (down.ggml_type, down.shape, down.data.dtype) == ("Q4_K", (256, 512), torch.uint8)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.norm.weight"].dtype == torch.float32


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_file_matches_transformers(tmp_path, arch):
    path, _ = write_tiny_gguf(tmp_path, arch)
    reference = transformers_state_dict(path)
    got = dequantized(path)
    assert set(got) == set(reference)
    for name, value in got.items():
        assert torch.equal(value.float(), reference[name]), name


@pytest.mark.parametrize(
    ("arch", "architecture"),
    [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")],
)
def test_config_from_metadata(tmp_path, arch, architecture):
    path, _ = write_tiny_gguf(tmp_path, arch)
    config = gguf_config(path)
    assert config.architectures == [architecture]
    assert (config.max_position_embeddings, config.vocab_size) == (512, 260)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert getattr(config, "head_dim", HEAD_DIM) == HEAD_DIM


def test_unsupported_architecture_is_named(tmp_path, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path, "qwen2")
    monkeypatch.delitem(gguf_file.ARCHITECTURES, "qwen2")
    with pytest.raises(ValueError, match=r"qwen2 model; supported: llama"):
        gguf_config(path)


def test_names():
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
    assert hf_name("blk.3.ffn_down_exps.weight") == "model.layers.3.mlp.experts.down_proj.weight"
    with pytest.raises(ValueError, match=r"blk\.0\.ssm_conv1d\.weight"):
        hf_name("blk.0.ssm_conv1d.weight")


def test_unknown_type_is_an_error_naming_the_tensor(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "llama", types={"blk.1.ffn_up.weight": "Q2_K"})
    tensors = dict(iterate_gguf(path))
    up = tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has type Q2_K"):
        up.to_block_quant()


def _default_gguf():
    from models.default import find_gguf

    try:
        return find_gguf()
    except (RuntimeError, importlib.metadata.PackageNotFoundError) as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_default_model_file_matches_transformers():
    path = _default_gguf()
    reference = transformers_state_dict(path)
    got = dequantized(path)
    assert set(reference) - set(got) == {"lm_head.weight"}  # tied to the embedding
    for name, value in got.items():
        assert torch.equal(value.float(), reference[name]), name


def test_read_gguf_agrees_with_gguf_py(tmp_path):
    """read_gguf (the loader's reader) against gguf-py's GGUFReader on a file of every value
    type, arrays of numbers, strings and arrays among them, an alignment of 64 and plain
    and quantized tensors: the same scalars and strings, the same tensor bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    path = tmp_path / "values.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strings", ["a", "bb", "ccc"])
    writer.add_key_value("t.nested", [[1, 2], [3]], GGUFValueType.ARRAY)
    writer.add_string("t.after", "still read")
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((7,)).astype(np.float16))
    q8 = rng.integers(0, 256, (4, 2 * 34), dtype=np.uint8)  # Q8_0: 4 rows of 64 values
    writer.add_tensor("c.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    metadata, tensors = gguf_file.read_gguf(path)
    reader = GGUFReader(path)
    scalars = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.") and field.types[0] != GGUFValueType.ARRAY
    }
    assert {k: v for k, v in metadata.items() if v is not None} == scalars
    assert metadata["t.after"] == "still read" and metadata["t.u64"] == 2**63 + 5
    assert [k for k, v in metadata.items() if v is None] == ["t.ints", "t.strings", "t.nested"]
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(tensors, reader.tensors, strict=True):
        assert mine.type_name == theirs.tensor_type.name
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape.tolist()))
        assert mine.data.tobytes() == np.asarray(theirs.data).tobytes()
    assert tensors[0].shape == (3, 5) and tensors[2].shape == (4, 64)


def test_read_gguf_refuses_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a little-endian GGUF file of version 2 or 3"):
        gguf_file.read_gguf(path)
