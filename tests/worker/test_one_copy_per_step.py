"""One host-to-device copy per step. With a separate device arena forced on CPU, every
ModelRunner step (prefill, mixed, decode; eager and padded like a CUDA-graph replay; one
and two KV cache groups) copies from the host arena exactly once, into the device arena,
and nothing else writes the device arena; every input the step reads on the device (ids,
positions, attention metadata and its split, logits indices, sampling settings) is a view
of the device arena. On CUDA the arena is always separate, so the count there is this."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ipc.config import EngineConfig
from ipc.messages import NewRequestData
from ipc.sampling_params import SamplingParams
from tests.worker.scheduler_outputs import decoding, runner_step
from worker import model_runner as model_runner_module
from worker.model_runner import ModelRunner
from worker.staging_arena import StagingArena

aten = torch.ops.aten
COPIES = (aten.copy_.default, aten._to_copy.default, aten.copy.default)


class ArenaTraffic(TorchDispatchMode):
    """The copies that read the host arena, and the ops that write the device arena."""

    def __init__(self, arena: StagingArena) -> None:
        super().__init__()
        self.host = arena.host.untyped_storage().data_ptr()
        self.device = arena.device_bytes.untyped_storage().data_ptr()
        self.copies_from_host: list[tuple[str, bool]] = []  # (op, into the device arena)
        self.device_writes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in COPIES:
            src = args[1] if func is aten.copy_.default else args[0]
            if _storage(src) == self.host:
                into_device = func is aten.copy_.default and _storage(args[0]) == self.device
                self.copies_from_host.append((str(func), into_device))
        for schema_arg, value in zip(func._schema.arguments, args, strict=False):
            written = schema_arg.alias_info is not None and schema_arg.alias_info.is_write
            if written and _storage(value) == self.device:
                self.device_writes.append(str(func))
        return func(*args, **kwargs)


def _storage(value) -> int | None:
    return value.untyped_storage().data_ptr() if isinstance(value, torch.Tensor) else None


def _device_inputs(step) -> dict[str, torch.Tensor]:
    """Every tensor of the step's inputs that a forward or the sampler reads."""
    tensors = {
        "input_ids": step.input_ids,
        "positions": step.positions,
        "logits_indices": step.logits_indices,
    }
    sampling = step.sampling_metadata
    if sampling is not None:
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(sampling, name) is not None:
                tensors[name] = getattr(sampling, name)
    for g, md in enumerate(step.attn_metadata or []):
        split = md.split
        named = {
            "query_start_loc": md.query_start_loc,
            "seq_lens": md.seq_lens,
            "block_table": md.block_table,
            "decode_reqs": split.decode_reqs,
            "prefill_reqs": split.prefill_reqs,
            "decode_rows": split.decode_rows,
            "prefill_rows": split.prefill_rows,
            "prefill_query_start_loc": split.prefill_query_start_loc,
            "prefill_seq_start_loc": split.prefill_seq_start_loc,
        }
        for i, group in enumerate(split.decode_groups):
            named[f"decode_group{i}_reqs"] = group.reqs
            named[f"decode_group{i}_rows"] = group.rows
        tensors |= {f"{k}[{g}]": v for k, v in named.items() if isinstance(v, torch.Tensor)}
    return tensors


@pytest.mark.parametrize("checkpoint", ["llama", "qwen2-hybrid"], indirect=True)
@pytest.mark.parametrize("mode", ["eager", "padded_eager"])
def test_every_step_copies_once_from_the_host_arena(checkpoint, mode, monkeypatch):
    config = EngineConfig(
        model=checkpoint,
        dtype="float32",
        max_model_len=64,
        block_size=8,
        num_gpu_blocks_override=32,
        max_num_seqs=8,
        attention_backend="torch",
        cuda_graph_sizes=[1, 2, 4, 8],
    )
    runner = ModelRunner(config, separate_device_arena=True)
    runner.initialize_kv_cache(32)
    if mode == "padded_eager":
        runner.capture_cuda_graphs(mode="padded_eager")
    arena = runner.inputs.arena
    assert arena.separate and arena.device_bytes.data_ptr() != arena.host.data_ptr()
    num_groups = len(runner.kv_cache_groups)
    assert num_groups == (2 if "qwen2" in checkpoint else 1)
    seen = []
    prepare = model_runner_module.prepare_inputs

    def recording(*args, **kwargs):
        seen.append(prepare(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(model_runner_module, "prepare_inputs", recording)

    def blocks(*ids):
        return [[i + 10 * g for i in ids] for g in range(num_groups)]

    greedy = SamplingParams(temperature=0, max_tokens=8)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=5, min_p=0.05, seed=1, max_tokens=8)
    new = [
        NewRequestData("a", [5, 6], greedy, blocks(1), 0),
        NewRequestData("b", list(range(30, 50)), seeded, blocks(2, 3, 4), 0),
        NewRequestData("c", [7, 8, 9], greedy, blocks(5), 0),
    ]
    steps = [("prefill", runner_step(0, new, scheduled={"a": 2, "b": 8, "c": 3}))]
    running = [  # (kind, tokens computed before the step, tokens scheduled): b in chunks
        ("mixed", {"a": 2, "b": 8, "c": 3}, {"a": 1, "b": 8, "c": 1}),
        ("mixed", {"a": 3, "b": 16, "c": 4}, {"a": 1, "b": 4, "c": 1}),
        ("decode", {"a": 4, "b": 20, "c": 5}, {"a": 1, "b": 1, "c": 1}),
        ("decode", {"a": 5, "b": 21, "c": 6}, {"a": 1, "b": 1, "c": 1}),
    ]
    for step_id, (kind, computed, scheduled) in enumerate(running, start=1):
        cached = decoding(computed, num_groups)
        steps.append((kind, runner_step(step_id, cached=cached, scheduled=scheduled)))
    for kind, scheduler_output in steps:
        with ArenaTraffic(arena) as traffic:
            output = runner.execute_model(scheduler_output)
        step = seen[-1]
        assert traffic.copies_from_host == [("aten.copy_.default", True)], kind
        assert traffic.device_writes == ["aten.copy_.default"], kind
        assert (step.graph_size is not None) == (mode == "padded_eager" and kind == "decode")
        for name, tensor in _device_inputs(step).items():
            assert _storage(tensor) == _storage(arena.device_bytes), (kind, name)
        assert bool(output.sampled_token_ids[1]) == (scheduler_output.step_id >= 2)  # b's chunks
    mixed = seen[1].attn_metadata[0].split
    assert mixed.prefill_reqs.tolist() == [1] and isinstance(mixed.decode_rows, torch.Tensor)
    assert (
        seen[2].sampling_metadata.top_k is not None and seen[2].sampling_metadata.top_p is not None
    )
