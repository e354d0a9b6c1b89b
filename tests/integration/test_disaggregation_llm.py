"""Prefill/decode disaggregation between two engines: a producer prefills (max_tokens 1,
do_remote_decode), a consumer pulls the prompts' KV and decodes. Its greedy tokens equal
transformers'; it computed only each prompt's last token; the pulled pages are what it
attends to (scrambling the producer's cache before the pull changes the output); a pull
that cannot reach the producer costs a recompute, not correctness."""

from __future__ import annotations

import pytest
import torch

from ipc.kv_transfer import KVTransferParams
from ipc.sockets import free_tcp_port
from splitserve import SamplingParams
from tests.integration.greedy import MAX_TOKENS, float32_engine, greedy_reference, random_prompts

PREFILL = SamplingParams(
    temperature=0.0, max_tokens=1, kv_transfer_params=KVTransferParams(do_remote_decode=True)
)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    path = tiny_checkpoint()
    port = free_tcp_port(count=1)
    extra = {"credentials": str(tmp_path_factory.mktemp("kv") / "kv.credentials")}
    config = {"kv_port": port, "kv_connector_extra_config": {**extra, "pull_timeout_s": 2.0}}
    producer = float32_engine(path, kv_transfer_config={**config, "kv_role": "kv_producer"})
    consumer = float32_engine(path, kv_transfer_config={**config, "kv_role": "kv_consumer"})
    yield producer, consumer, greedy_reference(path)
    producer.shutdown()
    consumer.shutdown()


def decode_params(prefilled) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            kv_transfer_params=KVTransferParams.from_dict(out.kv_transfer_params),
        )
        for out in prefilled
    ]


def kv_tensors(llm) -> list[torch.Tensor]:
    return llm.engine.executor.runner.kv_connector.tensors


def test_decode_instance_continues_from_the_pulled_kv(engines):
    producer, consumer, greedy = engines
    prompts = random_prompts(4, 9, 70, seed=1)
    prefilled = producer.generate(prompts, PREFILL, use_tqdm=False)
    assert all(out.kv_transfer_params["do_remote_prefill"] for out in prefilled)
    decoded = consumer.generate(prompts, decode_params(prefilled), use_tqdm=False)
    for prompt, first, out in zip(prompts, prefilled, decoded, strict=True):
        assert out.outputs[0].token_ids == greedy(prompt)
        assert out.outputs[0].token_ids[0] == first.outputs[0].token_ids[0]
        assert out.num_cached_tokens == len(prompt) - 1
    stats = consumer.engine.get_stats()
    block_size = consumer.config.block_size
    num_blocks = sum(-(-(len(p) - 1) // block_size) for p in prompts)
    bytes_per_block = consumer.engine.executor.runner.kv_cache_bytes_per_block()
    assert stats.kv_transfer_pulls >= len(prompts)
    assert stats.kv_transfer_pulled_bytes >= num_blocks * bytes_per_block
    assert producer.engine.scheduler.remote_kv.held  # until the producer steps again
    for _ in range(50):
        producer.engine.step()
        if not producer.engine.scheduler.remote_kv.held:
            break
    pool = producer.engine.kv_cache_manager.block_pool
    assert not producer.engine.scheduler.remote_kv.held
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_the_pulled_pages_are_what_the_decode_attends_to(engines):
    producer, consumer, greedy = engines
    prompts = random_prompts(3, 40, 60, seed=2)
    prefilled = producer.generate(prompts, PREFILL, use_tqdm=False)
    generator = torch.Generator().manual_seed(0)
    for tensor in kv_tensors(producer):
        tensor.copy_(10 * torch.randn(tensor.shape, generator=generator))
    decoded = consumer.generate(prompts, decode_params(prefilled), use_tqdm=False)
    assert all(out.num_cached_tokens == len(p) - 1 for p, out in zip(prompts, decoded, strict=True))
    assert any(
        out.outputs[0].token_ids != greedy(p) for p, out in zip(prompts, decoded, strict=True)
    )


def test_an_unreachable_producer_costs_a_recompute(engines):
    producer, consumer, greedy = engines
    prompts = random_prompts(2, 20, 30, seed=3)
    prefilled = producer.generate(prompts, PREFILL, use_tqdm=False)
    params = decode_params(prefilled)
    for p in params:
        p.kv_transfer_params.remote_port = free_tcp_port(count=1)
    decoded = consumer.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, decoded, strict=True):
        assert out.outputs[0].token_ids == greedy(prompt)
        assert out.num_cached_tokens == 0


@pytest.mark.slow  # 23 s (the pulls of one rank are tested above)
def test_tensor_parallel_ranks_pull_their_own_shards(tiny_checkpoint, tmp_path):
    """tp 2 on both sides: rank r pulls from rank r, and the ranks agree on what landed."""
    path = tiny_checkpoint()
    config = {
        "kv_port": free_tcp_port(count=2),
        "kv_connector_extra_config": {"credentials": str(tmp_path / "kv.credentials")},
    }
    engines = [
        float32_engine(path, tensor_parallel_size=2, kv_transfer_config={**config, "kv_role": r})
        for r in ("kv_producer", "kv_consumer")
    ]
    producer, consumer = engines
    try:
        greedy = greedy_reference(path)
        prompts = random_prompts(3, 20, 50, seed=4)
        prefilled = producer.generate(prompts, PREFILL, use_tqdm=False)
        assert all(out.kv_transfer_params["remote_tp_size"] == 2 for out in prefilled)
        decoded = consumer.generate(prompts, decode_params(prefilled), use_tqdm=False)
        for prompt, out in zip(prompts, decoded, strict=True):
            assert out.outputs[0].token_ids == greedy(prompt)
            assert out.num_cached_tokens == len(prompt) - 1
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.mark.parametrize("producer_budget", [None, 6], ids=["whole prompts", "chunked"])
def test_sliding_window_groups(tiny_checkpoint, tmp_path, producer_budget):
    """Window groups travel as any other; a producer that prefilled in chunks dropped the
    blocks before its window, so the consumer computes those prompts itself."""
    path = tiny_checkpoint("qwen2-hybrid")  # a full and a window-8 group
    config = {
        "kv_port": free_tcp_port(count=1),
        "kv_connector_extra_config": {"credentials": str(tmp_path / "kv.credentials")},
    }
    common = {"block_size": 4, "kv_cache_memory": 4 << 20}
    producer = float32_engine(
        path,
        max_num_batched_tokens=producer_budget,
        kv_transfer_config={**config, "kv_role": "kv_producer"},
        **common,
    )
    consumer = float32_engine(
        path, kv_transfer_config={**config, "kv_role": "kv_consumer"}, **common
    )
    try:
        greedy = greedy_reference(path)
        prompts = random_prompts(3, 20, 40, seed=5)
        prefilled = producer.generate(prompts, PREFILL, use_tqdm=False)
        decoded = consumer.generate(prompts, decode_params(prefilled), use_tqdm=False)
        pulled = producer_budget is None
        for prompt, out in zip(prompts, decoded, strict=True):
            assert out.outputs[0].token_ids == greedy(prompt)
            assert (out.num_cached_tokens == len(prompt) - 1) == pulled
    finally:
        producer.shutdown()
        consumer.shutdown()
