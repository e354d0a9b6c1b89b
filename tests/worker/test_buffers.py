"""Persistent input buffers: one host/device pair per input, written every step in place."""

import numpy as np
import pytest
import torch

from engine_core import EngineConfig
from ipc.messages import NewRequestData
from ipc.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_checkpoint
from tests.worker.scheduler_outputs import decoding, runner_step
from worker.buffers import CpuGpuBuffer, InputBuffers
from worker.model_runner import ModelRunner


def test_on_cpu_the_device_tensor_is_the_host_tensor():
    buffer = CpuGpuBuffer(6, dtype=torch.int64, device="cpu")
    assert buffer.gpu is buffer.cpu and not buffer.cpu.is_pinned()
    buffer.np[:3] = [4, 5, 6]
    rows = buffer.commit(3)
    assert rows.tolist() == [4, 5, 6] and rows.data_ptr() == buffer.cpu.data_ptr()


def test_a_staged_buffer_copies_the_rows_asked_for():
    buffer = CpuGpuBuffer(3, 2, dtype=torch.int32, device="cpu", staged=True)
    assert buffer.gpu is not buffer.cpu
    buffer.np[:] = [[1, 2], [3, 4], [5, 6]]
    assert buffer.commit(2).tolist() == [[1, 2], [3, 4]]
    assert buffer.gpu.tolist() == [[1, 2], [3, 4], [0, 0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_host_side_is_pinned():
    buffer = CpuGpuBuffer(4, dtype=torch.int64, device="cuda")
    assert buffer.cpu.is_pinned() and buffer.gpu.is_cuda
    buffer.np[:] = [1, 2, 3, 4]
    assert buffer.commit(2).tolist() == [1, 2]


def test_padding_rows_are_one_token_requests():
    buffers = InputBuffers(
        max_num_reqs=8, max_num_tokens=8, max_num_blocks_per_req=2, device=torch.device("cpu")
    )
    buffers.input_ids.np[:8] = 9
    buffers.query_start_loc.np[:4] = [0, 1, 2, 3]
    buffers.pad_decodes(3, 6)
    assert buffers.input_ids.np[:7].tolist() == [9, 9, 9, 0, 0, 0, 9]
    assert buffers.positions.np[3:6].tolist() == [0, 0, 0]
    assert buffers.seq_lens.np[3:6].tolist() == [1, 1, 1]
    assert buffers.query_start_loc.np[:7].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert (buffers.slot_mapping == -1).all()


def test_every_step_writes_the_same_buffers(tmp_path, monkeypatch):
    """A prefill step and a decode step: the metadata's tensors are views of the runner's
    persistent buffers (so a step's values last until the next step), holding the step's
    values."""
    path = make_tiny_checkpoint(tmp_path, "llama")
    config = EngineConfig(
        model=path, dtype="float32", max_model_len=64, block_size=4, num_gpu_blocks_override=16
    )
    runner = ModelRunner(config)
    runner.initialize_kv_cache(16)
    seen = []
    backend_class = type(runner.attn_backend)
    build = backend_class.build_metadata

    def recording(backend, common):
        values = (common.query_start_loc_cpu, common.seq_lens, common.slot_mapping)
        seen.append((common, [t.tolist() for t in values]))
        return build(backend, common)

    monkeypatch.setattr(backend_class, "build_metadata", recording)
    params = SamplingParams(temperature=0, max_tokens=4)
    new = [
        NewRequestData("a", [5, 6, 7], params, [[3]], 0),
        NewRequestData("b", [8], params, [[5]], 0),
    ]
    runner.execute_model(runner_step(0, new))
    cached = decoding({"a": 3, "b": 1})
    runner.execute_model(runner_step(1, cached=cached, scheduled={"a": 1, "b": 1}))

    buffers = runner.inputs
    for common, _ in seen:
        assert common.query_start_loc.data_ptr() == buffers.query_start_loc.gpu.data_ptr()
        assert common.query_start_loc_cpu.data_ptr() == buffers.query_start_loc.cpu.data_ptr()
        assert common.seq_lens.data_ptr() == buffers.seq_lens.gpu.data_ptr()
        assert common.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()
    (_, prefill), (_, decode) = seen
    assert prefill == [[0, 3, 4], [3, 1], [3 * 4, 3 * 4 + 1, 3 * 4 + 2, 5 * 4]]
    assert decode == [[0, 1, 2], [4, 2], [3 * 4 + 3, 5 * 4 + 1]]
    assert np.array_equal(buffers.positions.np[:2], [3, 1])


def test_the_runner_sizes_its_token_buffers_by_its_device_budget(runner):
    """Without --max-num-batched-tokens the runner's step inputs hold its device's default
    budget, the one the EngineCore's scheduler resolves from the same device."""
    expected = {"cpu": 2048, "cuda": 8192}[runner.device.type]
    assert runner.config.max_num_batched_tokens is None
    assert runner.max_num_tokens == runner.config.token_budget(runner.device.type) == expected
    assert runner.inputs.input_ids.np.shape == runner.inputs.positions.np.shape == (expected,)
