"""AWQ, GPTQ and compressed-tensors tensors: unpacking against the test packers, the
repack into a BlockQuantWeight (act-order included), TP sharding and bad input."""

from types import SimpleNamespace

import pytest
import torch

from kernels import KernelSet
from models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from models.quantization import building_with, get_quantization_config
from models.quantization.awq import AWQ_ORDER
from models.quantization.int_checkpoint import IntWeight, to_block_quant, unpack_int32
from tests.quantization.int_formats import IntFormat
from tests.quantization.int_packers import AWQ_PACK_ORDER, group_ids, pack_int32, rtn


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize(("bits", "awq_order"), [(4, False), (8, False), (4, True)])
def test_unpack_inverts_the_packers(bits, dim, awq_order):
    codes = torch.randint(0, 1 << bits, (64, 48) if dim == 0 else (48, 64))
    packed = pack_int32(codes, bits, dim, AWQ_PACK_ORDER if awq_order else None)
    assert packed.dtype == torch.int32 and packed.shape[dim] == 64 * bits // 32
    unpacked = unpack_int32(packed, bits, dim, AWQ_ORDER if awq_order else None)
    assert torch.equal(unpacked, codes.to(torch.uint8))


def test_awq_nibble_order_is_the_format_s():
    """Codes 0..7 of one AWQ word sit in nibbles 0, 4, 1, 5, 2, 6, 3, 7."""
    assert pack_int32(torch.arange(8).view(1, 8), 4, 1, AWQ_PACK_ORDER).item() == 0x75316420
    word = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert unpack_int32(word, 4, 1, AWQ_ORDER).tolist() == [list(range(8))]


def _logical(bq, index, k):
    """The [N, K] weight a repacked (weight, input index) computes with."""
    w = bq.dequantize()
    if index is None:
        return w
    out = torch.zeros(w.shape[0], k + 1)
    out[:, index] = w
    return out[:, :k]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize(
    ("k", "group", "act_order"), [(128, 32, False), (256, 128, False), (256, 64, True)]
)
def test_repack_is_exact_in_float32(bits, sym, k, group, act_order):
    w = torch.randn(24, k)
    perm = torch.randperm(k) if act_order else None
    qw = rtn(w, bits, group_ids(k, group, perm), sym)
    zeros = None if sym else qw.zeros
    ids = qw.g_idx if act_order else None
    weight = IntWeight(bits, qw.q.to(torch.uint8), qw.scales.float(), zeros, ids)
    bq, index = to_block_quant(weight, torch.float32)
    assert (bq.bits, bq.block_size, index is None) == (bits, group, not act_order)
    assert (bq.mins is None) == (sym and bits == 8)
    assert torch.equal(_logical(bq, index, k), qw.dequantize())
    bq16, _ = to_block_quant(weight, torch.float16)
    assert bq16.scales.dtype == torch.float16
    torch.testing.assert_close(_logical(bq16, index, k), qw.dequantize(), rtol=0, atol=1e-2)


def test_uneven_groups_are_padded_to_whole_blocks():
    """A row-parallel act-order shard holds parts of groups of any size."""
    g_idx = torch.tensor([2, 0, 0, 1] * 16 + [2] * 8)  # groups of 32, 16 and 24 features
    qw = rtn(torch.randn(8, 72), 4, g_idx, sym=False)
    weight = IntWeight(4, qw.q.to(torch.uint8), qw.scales.float(), qw.zeros, qw.g_idx)
    bq, index = to_block_quant(weight, torch.float32)
    assert bq.block_size == 32 and bq.shape == (8, 96)
    assert (index == 72).sum() == 24  # 16 + 8 zero features pad groups 1 and 2
    assert torch.equal(_logical(bq, index, 72), qw.dequantize())


LAYERS = {
    "column": (lambda: ColumnParallelLinear(128, 64, bias=False, prefix="l.o_proj"), [None]),
    "merged": (
        lambda: MergedColumnParallelLinear(128, [64, 64], bias=False, prefix="l.gate_up_proj"),
        [0, 1],
    ),
    "qkv": (lambda: QKVParallelLinear(128, 32, 4, 2, bias=False, prefix="l.qkv_proj"), "qkv"),
    "row": (lambda: RowParallelLinear(256, 64, bias=False, prefix="l.down_proj"), [None]),
}
HF_NAMES = {0: "gate_proj", 1: "up_proj", "q": "q_proj", "k": "k_proj", "v": "v_proj"}
FORMATS = [
    IntFormat("awq", group=64),
    IntFormat("gptq", bits=4, group=32, sym=True),
    IntFormat("gptq", bits=8, group=64, desc_act=True),
    IntFormat("gptq", bits=4, group=-1, desc_act=True),
    IntFormat("compressed-tensors", bits=4, group=32),
    IntFormat("compressed-tensors", bits=8, group=-1, sym=True),
    IntFormat("compressed-tensors", bits=4, group=32, desc_act=True),
]


def _build(fmt: IntFormat, kind: str, weights: dict):
    config = get_quantization_config(fmt.method, SimpleNamespace(quantization_config=fmt.config()))
    make, _ = LAYERS[kind]
    with building_with(config):
        layer = make()
    for shard, (tensors, _) in weights.items():
        for name, tensor in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor, shard)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_each_rank_holds_its_narrow_of_the_full_weight(fake_tp, fmt, kind):
    make, shards = LAYERS[kind]
    fake_tp(0, 1)
    full_layer = make()
    weights = {}
    for shard in shards:
        rows = full_layer.output_shard(shard).total if shard is not None else 64
        name = f"l.{HF_NAMES.get(shard, kind)}"
        weights[shard] = fmt.quantize(name, torch.randn(rows, full_layer.input_size))
    full = _build(fmt, kind, weights)
    full_q = full.prepared_weight.row_weight()
    full_w = _logical(full_q, full.input_index, full.input_size)
    for rank in range(2):
        fake_tp(rank, 2)
        layer = _build(fmt, kind, weights)
        rows = [
            full.output_shard(shard).offset + layer.output_shard(shard).start
            for shard in shards
            if layer.output_shard(shard) is not None
        ]
        sizes = [layer.output_shard(s).size for s in shards if layer.output_shard(s) is not None]
        inp = layer.input_shard()
        want = _narrow_logical(full_w, rows, sizes, inp)
        layer_q = layer.prepared_weight.row_weight()
        got = _logical(layer_q, layer.input_index, layer.input_size_per_partition)
        assert torch.equal(got, want)
        layer.bind_kernels(KernelSet.for_device("cpu"))
        x = torch.randn(3, layer.input_size_per_partition)
        out, reference = layer.quant_method.apply(layer, x), x @ want.t()
        magnitude = x.abs() @ want.abs().t()  # float32 sums in another order or form
        assert ((out - reference).abs() <= 1e-5 * magnitude + 1e-5).all()
        if layer.input_index is None and layer_q.block_size == full_q.block_size:
            _assert_same(layer_q, _narrow(full_q, rows, sizes, inp))


def _narrow(w, rows, sizes, inp):
    """The rows and input features of a rank, from the full BlockQuantWeight."""
    if rows:
        parts = [w.narrow(0, r, n) for r, n in zip(rows, sizes, strict=True)]
        mins = None if w.mins is None else torch.cat([p.mins for p in parts])
        w = type(w)(
            w.bits,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            w.block_size,
        )
    return w if inp is None else w.narrow(1, inp.start, inp.size)


def _assert_same(got, expected):
    assert torch.equal(got.qweight, expected.qweight)
    assert torch.equal(got.scales, expected.scales)
    assert (got.mins is None) == (expected.mins is None)
    assert got.mins is None or torch.equal(got.mins, expected.mins)


def _narrow_logical(w, rows, sizes, inp):
    if rows:
        w = torch.cat([w[r : r + n] for r, n in zip(rows, sizes, strict=True)])
    return w if inp is None else w[:, inp.start : inp.start + inp.size]


def _config(method: str, **changes):
    config = {**IntFormat(method).config(), **changes}
    return get_quantization_config(method, SimpleNamespace(quantization_config=config))


@pytest.mark.parametrize(
    ("method", "changes", "message"),
    [
        ("awq", {"bits": 8}, "only 4-bit"),
        ("awq", {"version": "gemv"}, "only the GEMM version"),
        ("gptq", {"bits": 3}, "only 4- and 8-bit"),
        ("gptq", {"checkpoint_format": "marlin"}, "format 'marlin' is not supported"),
        ("compressed-tensors", {"format": "float-quantized"}, "'float-quantized'"),
    ],
)
def test_unsupported_checkpoints_are_clear_errors(method, changes, message):
    with pytest.raises(ValueError, match=message):
        _config(method, **changes)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"num_bits": 4, "strategy": "tensor"}, "strategy 'tensor'"),
        ({"num_bits": 8, "type": "float", "strategy": "channel"}, "weight-only int4/int8"),
        ({"num_bits": 4, "strategy": "channel", "actorder": "dynamic"}, "needs the group"),
        ({"num_bits": 4, "strategy": "group", "group_size": 32, "actorder": "x"}, "actorder 'x'"),
    ],
)
def test_unsupported_compressed_tensors_schemes_are_clear_errors(weights, message):
    group = {"targets": ["Linear"], "weights": weights}
    with pytest.raises(ValueError, match=message):
        _config("compressed-tensors", config_groups={"group_0": group})


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors"])
def test_group_that_does_not_divide_the_shard_is_an_error_naming_the_layer(fake_tp, method):
    fake_tp(1, 2)
    with building_with(_config(method)), pytest.raises(ValueError, match="down_proj: group size"):
        RowParallelLinear(192, 64, bias=False, prefix="model.layers.3.mlp.down_proj")


def test_act_order_shards_any_group_size(fake_tp):
    """With desc_act (actorder "group") the scales are replicated (the last group of 192
    features is 64), so the group need not divide the shard."""
    fake_tp(1, 2)
    with building_with(_config("gptq", desc_act=True)):
        layer = RowParallelLinear(192, 64, bias=False, prefix="l.down_proj")
    assert layer.scales.shape == (2, 64) and layer.scales.in_axis is None
    config = IntFormat("compressed-tensors", group=128, desc_act=True).config()
    with building_with(_config("compressed-tensors", **config)):
        layer = RowParallelLinear(192, 64, bias=False, prefix="l.down_proj")
    assert layer.weight_scale.shape == (64, 2) and layer.weight_scale.in_axis is None


def test_compressed_tensors_ignore_and_targets_pick_the_layers():
    group = {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 4, "strategy": "channel"}}
    config = _config("compressed-tensors", config_groups={"g": group}, ignore=["re:.*up_proj"])
    with building_with(config):
        down = RowParallelLinear(64, 64, bias=False, prefix="model.layers.0.mlp.down_proj")
        o = RowParallelLinear(64, 64, bias=False, prefix="model.layers.0.self_attn.o_proj")
        with pytest.raises(ValueError, match="quantized differently"):
            MergedColumnParallelLinear(64, [64, 64], prefix="model.layers.0.mlp.gate_up_proj")
    assert hasattr(down, "weight_packed") and hasattr(o, "weight")


def test_awq_modules_to_not_convert_stay_dense():
    with building_with(_config("awq", modules_to_not_convert=["down_proj"])):
        down = RowParallelLinear(64, 64, bias=False, prefix="model.layers.0.mlp.down_proj")
        qkv = QKVParallelLinear(128, 32, 4, 2, bias=False, prefix="model.layers.0.attn.qkv_proj")
    assert hasattr(down, "weight") and hasattr(qkv, "qweight")
    config = _config("awq", modules_to_not_convert=["k_proj"])
    with building_with(config), pytest.raises(ValueError, match="quantized differently"):
        QKVParallelLinear(128, 32, 4, 2, bias=False, prefix="l.qkv_proj")


def test_a_16_bit_model_computes_with_float16_scales(fake_tp):
    fake_tp(0, 1)
    torch.manual_seed(0)
    fmt = IntFormat("gptq", bits=4, group=32, desc_act=True)
    weights = {None: fmt.quantize("l.down_proj", torch.randn(64, 256))}
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = _build(fmt, "row", weights)
    finally:
        torch.set_default_dtype(old)
    assert layer.prepared_weight.row_weight().scales.dtype == torch.float16
    layer.bind_kernels(KernelSet.for_device("cpu"))
    x = torch.randn(5, 256)
    out = layer.quant_method.apply(layer, x.bfloat16())
    assert out.dtype == torch.bfloat16
    # bf16 x is quantized to int8 per 32 features (half a step: max|x| / 254) on decode
    torch.testing.assert_close(out.float(), x @ weights[None][1].t(), rtol=0.05, atol=0.5)
