"""--quantization fp8: fp8 checkpoints (per-tensor and per-channel scales) and a 16-bit
checkpoint quantized at load; their parameters shard like the dense weight."""

import pytest
import torch

from models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from models.loader import load_model
from models.quantization import building_with
from models.quantization.cpu_fp8_linear import (
    FP8_DTYPE,
    Fp8Weight,
    quantize_fp8_per_channel,
)
from models.quantization.fp8 import Fp8Config, Fp8LinearMethod, Fp8OnlineLinearMethod
from splitserve import LLM
from tests.integration.greedy import random_prompts
from tests.quantization.fp8_checkpoint import from_fp8, to_fp8, write_fp8_checkpoint
from tests.quantization.reference import check_greedy, dequantized_reference

LAYERS = {
    "column": (lambda: ColumnParallelLinear(32, 16, bias=False), [(None, 16)]),
    "merged": (lambda: MergedColumnParallelLinear(32, [16, 32], bias=False), [(0, 16), (1, 32)]),
    "qkv": (lambda: QKVParallelLinear(32, 8, 4, 2, bias=False), [("q", 32), ("k", 16), ("v", 16)]),
    "row": (lambda: RowParallelLinear(32, 16, bias=False), [(None, 16)]),
}
STATIC = Fp8Config(checkpoint=True, static_input_scale=True)


def build(make, config):
    with building_with(config):
        return make()


def logical_weight(layer) -> torch.Tensor:
    layer.quant_method.process_weights_after_loading(layer)
    return Fp8Weight(layer.weight.data, layer.weight_scale.data).dequantize()


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_params_shard_like_the_dense_weight(fake_tp, kind, tp, per_channel):
    """Each projection's own per-tensor scale fills its rows of the fused layer."""
    make, projections = LAYERS[kind]
    stored = {
        shard: to_fp8(torch.randn(rows, 32) * (i + 1), per_channel)
        for i, (shard, rows) in enumerate(projections)
    }
    for rank in range(tp):
        fake_tp(rank, tp)
        dense, quant = build(make, None), build(make, STATIC)
        assert isinstance(quant.quant_method, Fp8LinearMethod)
        for i, (shard, (weight, scale)) in enumerate(stored.items()):
            dense.weight.weight_loader(dense.weight, from_fp8(weight, scale), shard)
            quant.weight.weight_loader(quant.weight, weight, shard)
            quant.weight_scale.weight_loader(quant.weight_scale, scale, shard)
            quant.input_scale.weight_loader(quant.input_scale, torch.tensor([i + 1.0]), shard)
        assert torch.equal(logical_weight(quant), dense.weight.data)
        assert quant.input_scale.item() == len(projections)  # the largest


def test_fused_checkpoint_with_one_scale(fake_tp):
    fake_tp(1, 2)
    make, _ = LAYERS["merged"]
    weight, scale = to_fp8(torch.randn(48, 32), per_channel=False)
    dense, quant = build(make, None), build(make, STATIC)
    dense.weight.weight_loader(dense.weight, from_fp8(weight, scale))
    for name, value in (("weight", weight), ("weight_scale", scale), ("input_scale", scale)):
        param = getattr(quant, name)
        param.weight_loader(param, value)
    assert torch.equal(logical_weight(quant), dense.weight.data)


def test_online_fp8_quantizes_this_ranks_shard(fake_tp):
    fake_tp(1, 2)
    make, _ = LAYERS["row"]
    w = torch.randn(16, 32)
    dense, quant = build(make, None), build(make, Fp8Config())
    assert isinstance(quant.quant_method, Fp8OnlineLinearMethod)
    dense.weight.weight_loader(dense.weight, w)
    quant.weight.weight_loader(quant.weight, w)
    expected = quantize_fp8_per_channel(dense.weight.data).dequantize()
    assert torch.equal(logical_weight(quant), expected)
    assert quant.weight.dtype == FP8_DTYPE


def test_16_bit_tensor_in_an_fp8_checkpoint_is_a_clear_error():
    layer = build(lambda: RowParallelLinear(32, 16, bias=False, prefix="model.x.o_proj"), STATIC)
    with pytest.raises(ValueError, match=r"model.x.o_proj.weight is torch.bfloat16, not float8"):
        layer.weight.weight_loader(layer.weight, torch.randn(16, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"weight_block_size": [128, 128]}, "block-wise weight scales"),
        ({"activation_scheme": "per_token"}, "activation_scheme must be"),
        ({"fmt": "e5m2"}, "'e5m2' is not supported"),
    ],
)
def test_unsupported_fp8_checkpoints_are_clear_errors(config, message):
    with pytest.raises(ValueError, match=message):
        Fp8Config.from_config({"quant_method": "fp8", **config})


def test_ignored_layers_stay_unquantized():
    attn = "model.layers.0.self_attn"
    config = Fp8Config.from_config(
        {"quant_method": "fp8", "ignored_layers": [f"{attn}.{p}_proj" for p in "qkv"]}
    )
    qkv = build(
        lambda: QKVParallelLinear(32, 8, 4, 2, bias=False, prefix=f"{attn}.qkv_proj"), config
    )
    assert type(qkv.quant_method) is UnquantizedLinearMethod
    partial = Fp8Config.from_config({"quant_method": "fp8", "ignored_layers": [f"{attn}.q_proj"]})
    with pytest.raises(ValueError, match="only some are fp8"):
        build(
            lambda: QKVParallelLinear(32, 8, 4, 2, bias=False, prefix=f"{attn}.qkv_proj"), partial
        )


@pytest.mark.parametrize(
    ("per_channel", "static", "ignored"),
    [(False, True, ()), (True, False, ("model.layers.1.mlp.down_proj",))],
    ids=["per-tensor-static", "per-channel-ignored"],
)
def test_fp8_checkpoint_greedy_matches_transformers(
    tmp_path, checkpoint, per_channel, static, ignored
):
    path = tmp_path / "fp8"
    dequantized = write_fp8_checkpoint(checkpoint, path, per_channel, static, ignored)
    model = load_model(str(path), "float32")
    layers = model.model.layers
    assert layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    assert layers[1].mlp.down_proj.weight.dtype == (torch.float32 if ignored else FP8_DTYPE)
    reference = dequantized_reference(checkpoint, lambda name, w: dequantized.get(name, w))
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**24)
    assert llm.config.quantization == "fp8"
    check_greedy(llm, reference, random_prompts(4, 3, 20))


def test_online_fp8_greedy_matches_transformers(checkpoint):
    reference = dequantized_reference(
        checkpoint, lambda name, w: quantize_fp8_per_channel(w).dequantize()
    )
    llm = LLM(checkpoint, dtype="float32", quantization="fp8", kv_cache_memory=2**24)
    assert llm.config.quantization == "fp8"
    check_greedy(llm, reference, random_prompts(4, 3, 20))
