"""The KV host tier: block copies against a page-by-page torch reference, a request swapped
out and back into other device blocks decoding as if never interrupted, and the sizes and
measured costs the workers report."""

import random

import pytest
import torch

from ipc.config import EngineConfig
from ipc.messages import CachedRequestData, NewRequestData, SchedulerOutput
from ipc.sampling_params import SamplingParams
from worker.inproc_executor import InProcessExecutor
from worker.kv_offload import HostKVCache
from worker.model_runner import ModelRunner

PAGE_SHAPE = (4, 2, 8)  # block_size, num_kv_heads, head_dim


def random_pools(device_name, num_tensors, num_blocks, num_host_blocks, dtype, seed):
    """Random device pools (CUDA when there is a GPU: pinned host pools) and host pools."""
    generator = torch.Generator().manual_seed(seed)
    device = [
        torch.randn((2, num_blocks, *PAGE_SHAPE), generator=generator).to(device_name, dtype)
        for _ in range(num_tensors)
    ]
    host = HostKVCache(device, num_host_blocks)
    for tensor in host.host_tensors:
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(dtype))
    return host


def reference_copies(device, host, swap_out, swap_in):
    """One page at a time: every swap_out pair, then every swap_in pair."""
    device = [t.to("cpu", copy=True) for t in device]
    host = [t.clone() for t in host]
    for device_block, host_block in swap_out:
        for d, h in zip(device, host, strict=True):
            h[:, host_block] = d[:, device_block]
    for host_block, device_block in swap_in:
        for d, h in zip(device, host, strict=True):
            d[:, device_block] = h[:, host_block]
    return device, host


def assert_pools_equal(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # torch.equal has no fp8
            a, e = a.view(torch.uint8), e.view(torch.uint8)
        for block in range(a.shape[1]):
            assert torch.equal(a[:, block].cpu(), e[:, block]), f"page {block} differs"


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
)
@pytest.mark.parametrize("seed", range(4))
def test_copy_blocks_equals_page_by_page_copies(kernel_device, dtype, seed):
    rng = random.Random(seed)
    num_blocks, num_host_blocks = rng.randint(4, 24), rng.randint(4, 24)
    host = random_pools(kernel_device, rng.randint(1, 3), num_blocks, num_host_blocks, dtype, seed)
    device_ids = rng.sample(range(num_blocks), rng.randint(0, num_blocks))
    host_ids = rng.sample(range(num_host_blocks), rng.randint(0, num_host_blocks))
    num_out = rng.randint(0, min(len(device_ids), len(host_ids)))
    num_in = min(len(device_ids), len(host_ids)) - num_out
    swap_out = [[d, h] for d, h in zip(device_ids[:num_out], host_ids[:num_out], strict=True)]
    swap_in = [(h, d) for d, h in zip(device_ids[num_out:], host_ids[num_out:], strict=False)]
    assert len(swap_in) == num_in
    expected = reference_copies(host.device_tensors, host.host_tensors, swap_out, swap_in)

    host.copy_blocks(swap_out, swap_in)

    assert_pools_equal(host.device_tensors, expected[0])
    assert_pools_equal(host.host_tensors, expected[1])


def test_copy_blocks_runs_every_swap_out_before_any_swap_in(kernel_device):
    host = random_pools(kernel_device, 2, 6, 6, torch.float32, seed=7)
    assert all(t.is_pinned() == (kernel_device == "cuda") for t in host.host_tensors)
    old_device = [t.to("cpu", copy=True) for t in host.device_tensors]
    old_host = [t.clone() for t in host.host_tensors]

    host.copy_blocks([(3, 0), (1, 2)], [(4, 3), (5, 1)])  # device 3: out to host 0, in from 4

    for device, host_tensor, old_d, old_h in zip(
        host.device_tensors, host.host_tensors, old_device, old_host, strict=True
    ):
        assert torch.equal(host_tensor[:, 0], old_d[:, 3])
        assert torch.equal(host_tensor[:, 2], old_d[:, 1])
        assert torch.equal(device[:, 3].cpu(), old_h[:, 4])
        assert torch.equal(device[:, 1].cpu(), old_h[:, 5])


def test_empty_copy_lists_change_nothing(kernel_device):
    host = random_pools(kernel_device, 2, 5, 5, torch.float32, seed=3)
    before = [t.to("cpu", copy=True) for t in host.device_tensors + host.host_tensors]
    host.copy_blocks([], [])
    assert_pools_equal(host.device_tensors + host.host_tensors, before)


# The runner: block_size 8, fp32, a tiny random Llama (2 layers, 2 KV heads of 16 each): a
# block is K and V of 8 tokens in each layer.
BLOCK_BYTES = 2 * 2 * 8 * 2 * 16 * 4
NUM_HOST_BLOCKS = 12


def offload_config(path, kv_offload_memory: int) -> EngineConfig:
    return EngineConfig(
        model=path,
        dtype="float32",
        max_model_len=64,
        block_size=8,
        kv_cache_memory=1 << 20,
        kv_offload_memory=kv_offload_memory,
    )


@pytest.fixture(scope="module")
def offload_runner(checkpoint) -> ModelRunner:
    runner = ModelRunner(offload_config(checkpoint, NUM_HOST_BLOCKS * BLOCK_BYTES + 100))
    runner.initialize_kv_cache(32, runner.determine_num_host_blocks())
    return runner


PROMPT = [5, 77, 3, 200, 9, 8, 7, 6, 5, 4, 3]  # 11 tokens; 16 fit in two blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def decode(runner, step_id, req_id, num_computed, **copies) -> int:
    cached = CachedRequestData([req_id], [False], [[]], [[[]]], [num_computed])
    out = runner.execute_model(SchedulerOutput(step_id, [], cached, {req_id: 1}, 1, **copies))
    return out.sampled_token_ids[0][0]


def prefill_and_decode(runner, req_id, blocks, num_decodes) -> list[int]:
    new = NewRequestData(req_id, PROMPT, GREEDY, [blocks], 0)
    out = runner.execute_model(
        SchedulerOutput(0, [new], CachedRequestData(), {req_id: len(PROMPT)}, len(PROMPT))
    )
    tokens = [out.sampled_token_ids[0][0]]
    for step in range(1, num_decodes + 1):
        tokens.append(decode(runner, step, req_id, len(PROMPT) + step - 1))
    return tokens


def finish(runner, req_id) -> None:
    runner.execute_model(SchedulerOutput(99, [], CachedRequestData(), {}, 0, [req_id]))


def device_pages(runner, blocks):
    return [layer.kv_cache[:, blocks].clone() for layer in runner.model.attention_layers()]


def test_a_request_swapped_out_and_in_to_other_blocks_decodes_as_if_never_interrupted(
    offload_runner,
):
    runner = offload_runner
    reference = prefill_and_decode(runner, "uninterrupted", [3, 4], 5)
    finish(runner, "uninterrupted")

    tokens = prefill_and_decode(runner, "swapped", [1, 2], 2)  # 13 tokens computed
    num_computed = len(PROMPT) + 2
    pages = device_pages(runner, [1, 2])
    out = runner.execute_model(
        SchedulerOutput(3, [], CachedRequestData(), {}, 0, blocks_to_swap_out=[[1, 7], [2, 5]])
    )
    assert out.req_ids == [] and out.sampled_token_ids == []
    for layer in runner.model.attention_layers():
        layer.kv_cache[:, [1, 2]] = 0.0

    resumed = CachedRequestData(
        ["swapped"], [True], [PROMPT + tokens], [[[10, 11]]], [num_computed]
    )
    out = runner.execute_model(
        SchedulerOutput(4, [], resumed, {"swapped": 1}, 1, blocks_to_swap_in=[[7, 10], [5, 11]])
    )
    for before, after in zip(pages, device_pages(runner, [10, 11]), strict=True):
        assert torch.equal(after[:, 0], before[:, 0])  # positions 0-7
        assert torch.equal(after[:, 1, :5], before[:, 1, :5])  # 8-12; 13 is this step's
    tokens.append(out.sampled_token_ids[0][0])
    for step in range(5, 7):
        tokens.append(decode(runner, step, "swapped", len(PROMPT) + step - 2))
    finish(runner, "swapped")
    assert tokens == reference


def test_copies_without_a_host_tier_are_an_error(runner):
    step = SchedulerOutput(0, [], CachedRequestData(), {}, 0, blocks_to_swap_in=[[0, 1]])
    with pytest.raises(RuntimeError, match="no host tier"):
        runner.execute_model(step)


def test_the_host_tier_is_sized_and_its_costs_measured_only_when_on(checkpoint, runner):
    on = ModelRunner(offload_config(checkpoint, NUM_HOST_BLOCKS * BLOCK_BYTES + 100))
    assert on.kv_cache_bytes_per_block() == BLOCK_BYTES
    assert on.determine_num_host_blocks() == NUM_HOST_BLOCKS
    on.determine_num_blocks()
    assert on.block_copy_seconds > 0 and on.prefill_token_seconds > 0

    assert runner.determine_num_host_blocks() == 0
    runner.determine_num_blocks()
    assert runner.block_copy_seconds == 0 and runner.prefill_token_seconds == 0
    assert runner.host_kv_cache is None


def test_the_in_process_executor_allocates_and_reports_the_host_tier(checkpoint):
    executor = InProcessExecutor(offload_config(checkpoint, NUM_HOST_BLOCKS * BLOCK_BYTES))
    spec = executor.initialize_workers()
    assert spec.num_host_blocks == NUM_HOST_BLOCKS
    assert executor.runner.host_kv_cache.num_host_blocks == NUM_HOST_BLOCKS
    device_shape = executor.runner.model.attention_layers()[0].kv_cache.shape
    host_shape = (2, NUM_HOST_BLOCKS, *device_shape[2:])
    assert [t.shape for t in executor.runner.host_kv_cache.host_tensors] == [host_shape] * 2
    assert spec.block_copy_seconds > 0 and spec.prefill_token_seconds > 0
    executor.shutdown()
