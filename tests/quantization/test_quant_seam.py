"""The quantization seam: methods own a layer's parameters, the layer shards them by
their axes (packed and grouped tensors included), --quantization is checked against the
checkpoint."""

import json

import pytest
import torch
from torch import nn

from ipc.config import resolve_quantization
from models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from models.layers.utils import set_shard_axes, set_weight_attrs
from models.quantization import LinearMethodBase, building_with, get_quantization_config
from models.quantization.base_config import QuantizationConfig

PACK, GROUP = 4, 8  # stored elements per output feature group / input features per scale


def packed(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stand-in for an AWQ-style checkpoint of the logical weight w [N, K]: `qweight`
    [K, N / PACK] (one element per PACK output features), `scales` [K / GROUP, N]."""
    return {"qweight": w.t()[:, ::PACK].contiguous(), "scales": w.t()[::GROUP].contiguous()}


class PackedMethod(LinearMethodBase):
    def create_weights(self, layer, in_part, out_parts, in_size, out_size, dtype):
        n = sum(out_parts)
        for name, shape, axes in (
            ("qweight", (in_part, n // PACK), {"out": (1, PACK), "inp": (0, 1)}),
            ("scales", (in_part // GROUP, n), {"out": (1, 1), "inp": (0, GROUP)}),
            ("tensor_scale", (len(out_parts),), {}),
        ):
            param = nn.Parameter(torch.zeros(shape), requires_grad=False)
            set_shard_axes(param, **axes)
            set_weight_attrs(param, {"weight_loader": layer.weight_loader})
            if name == "tensor_scale":
                param.per_shard = True
            layer.register_parameter(name, param)

    def apply(self, layer, x, bias=None):
        raise NotImplementedError


class PackedConfig(QuantizationConfig):
    name = "packed"

    def get_quant_method(self, layer, prefix):
        return PackedMethod()


def build(make, quantized: bool):
    with building_with(PackedConfig() if quantized else None):
        return make()


LAYERS = {
    "column": (lambda: ColumnParallelLinear(32, 16, bias=False), [(None, 16)]),
    "merged": (lambda: MergedColumnParallelLinear(32, [16, 32], bias=False), [(0, 16), (1, 32)]),
    "qkv": (lambda: QKVParallelLinear(32, 8, 4, 2, bias=False), [("q", 32), ("k", 16), ("v", 16)]),
    "row": (lambda: RowParallelLinear(32, 16, bias=False), [(None, 16)]),
}


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_params_shard_like_the_dense_weight(fake_tp, kind, tp):
    make, projections = LAYERS[kind]
    weights = {shard: torch.randn(rows, 32) for shard, rows in projections}
    for rank in range(tp):
        fake_tp(rank, tp)
        dense, quant = build(make, False), build(make, True)
        for i, (shard, w) in enumerate(weights.items()):
            dense.weight.weight_loader(dense.weight, w, shard)
            for name, tensor in packed(w).items():
                param = getattr(quant, name)
                param.weight_loader(param, tensor, shard)
            quant.tensor_scale.weight_loader(quant.tensor_scale, torch.tensor(i + 1.0), shard)
        expected = packed(dense.weight.data)
        torch.testing.assert_close(quant.qweight.data, expected["qweight"])
        torch.testing.assert_close(quant.scales.data, expected["scales"])
        assert quant.tensor_scale.tolist() == [float(i + 1) for i in range(len(projections))]


def test_fused_packed_checkpoint_is_split(fake_tp):
    fake_tp(1, 2)
    make, projections = LAYERS["merged"]
    dense, quant = build(make, False), build(make, True)
    fused = torch.randn(sum(rows for _, rows in projections), 32)
    dense.weight.weight_loader(dense.weight, fused)
    quant.qweight.weight_loader(quant.qweight, packed(fused)["qweight"])
    torch.testing.assert_close(quant.qweight.data, packed(dense.weight.data)["qweight"])


def test_group_that_does_not_divide_the_shard_is_a_clear_error(fake_tp):
    fake_tp(1, 2)
    with building_with(PackedConfig()):
        layer = RowParallelLinear(5 * GROUP, 16, bias=False)  # 20 per rank: 2.5 groups
    w = torch.randn(16, layer.input_size)
    with pytest.raises(ValueError, match="does not divide this tensor-parallel shard"):
        layer.scales.weight_loader(layer.scales, packed(w)["scales"])


def _folder(tmp_path, quant_method=None):
    config = {"architectures": ["LlamaForCausalLM"]}
    if quant_method:
        config["quantization_config"] = {"quant_method": quant_method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_quantization_follows_the_checkpoint(tmp_path):
    assert resolve_quantization("/x/model.Q4_1.gguf", None) == "gguf"
    assert resolve_quantization(_folder(tmp_path), None) is None
    assert resolve_quantization(_folder(tmp_path), "int8") == "int8"
    assert resolve_quantization(_folder(tmp_path), "fp8") == "fp8"
    (tmp_path / "awq").mkdir()
    awq = _folder(tmp_path / "awq", "AWQ")
    assert resolve_quantization(awq, None) == "awq"
    assert resolve_quantization(awq, "awq") == "awq"


@pytest.mark.parametrize(
    ("checkpoint", "requested", "message"),
    [
        (None, "gptq", "is not a gptq checkpoint"),
        (None, "nf4", "quantization must be one of"),
        ("awq", "gptq", "does not match"),
        ("awq", "int8", "does not match"),
        ("bitsandbytes", None, "'bitsandbytes' is not supported"),
    ],
)
def test_quantization_mismatch_is_a_clear_error(tmp_path, checkpoint, requested, message):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(_folder(tmp_path, checkpoint), requested)


def test_no_quantization_builds_no_config():
    assert get_quantization_config(None, object()) is None
