"""splitserve.LLM with tensor_parallel_size=2 runs worker processes and answers as
transformers' greedy generate; a worker that cannot start is reported by rank."""

from __future__ import annotations

import gc
import shutil
import tempfile
from pathlib import Path

import pytest

from ipc.executor import WorkerFailure
from ipc.processes import pid_alive
from ipc.sampling_params import SamplingParams
from splitserve import LLM, cluster
from tests.integration.greedy import greedy_reference
from tests.models.tiny import make_tiny_checkpoint

PROMPTS = [[5, 77, 3, 200], [9, 8, 7, 6, 5, 4, 3, 2, 1], [100] * 20]


@pytest.mark.gpus(2)
def test_llm_tp2_equals_transformers(qwen3_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    llm = LLM(qwen3_path, tensor_parallel_size=2, dtype="float32", kv_cache_memory=64 << 20)
    executor = llm.engine.executor
    pids = [w.pid for w in executor.workers]
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    greedy = greedy_reference(qwen3_path, ignore_eos=False)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy(p, 8) for p in PROMPTS]
    assert all(pid_alive(p) for p in pids)
    del llm, executor, outputs
    gc.collect()  # the executor's finalizer stops its workers
    assert not any(pid_alive(p) for p in pids)


@pytest.mark.gpus(2)
def test_llm_tp2_hybrid_kv_cache_groups(tiny_checkpoint, monkeypatch):
    """Gemma 3 (five window layers to one global) over worker processes: the ranks report
    their KV cache groups in WorkerReady and the EngineCore manages one per group. The
    ranks also size a KV host tier and measure its costs."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tiny_checkpoint("gemma3")
    llm = LLM(
        path,
        tensor_parallel_size=2,
        dtype="float32",
        kv_cache_memory=16 << 20,
        block_size=4,
        kv_offload_memory=64 << 10,
    )
    spec = llm.engine.worker_spec
    assert spec.kv_cache_groups == (8,) * 5 + (None,)
    # A block: K and V of 4 tokens in one layer (groups of one layer), 1 head of 16 per rank.
    assert spec.num_host_blocks == (64 << 10) // (2 * 4 * 1 * 16 * 4)
    assert spec.block_copy_seconds > 0 and spec.prefill_token_seconds > 0
    assert llm.engine.kv_cache_manager.group_windows == (8,) * 5 + (None,)
    prompts = PROMPTS + [list(range(3, 40))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    greedy = greedy_reference(path, ignore_eos=False)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy(p, 12) for p in prompts]


@pytest.mark.gpus(2)
def test_llm_tp2_swap_preemption(qwen3_path, monkeypatch):
    """Both ranks run each step's block copies (the SchedulerOutput is broadcast): requests
    swapped out to the host tier and back give transformers' greedy tokens, also with
    async scheduling (a request is preempted while its last step is in flight)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    llm = LLM(
        qwen3_path,
        tensor_parallel_size=2,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=17,  # one request of max_model_len
        kv_offload_memory=1 << 20,
        preemption_mode="swap",
        async_scheduling=True,
    )
    assert llm.engine.max_in_flight == 1
    prompts = [list(range(n, n + 30)) for n in (3, 40, 90, 150)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    greedy = greedy_reference(qwen3_path, ignore_eos=False)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy(p, 10) for p in prompts]
    stats = llm.engine.get_stats()
    assert stats.num_swapped_out_blocks > 0
    assert stats.num_swapped_in_blocks >= stats.num_swapped_out_blocks


@pytest.mark.gpus(2)
def test_worker_start_failure_names_the_rank(tmp_path, monkeypatch, request):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Not under tmp_path: its length (xdist's adds a folder) can pass a socket path's 107 bytes.
    ipc_dir = Path(tempfile.mkdtemp(prefix="ipc-"))
    request.addfinalizer(lambda: shutil.rmtree(ipc_dir, ignore_errors=True))
    monkeypatch.setattr(tempfile, "tempdir", str(ipc_dir))  # where new_ipc_address goes
    started, real_start_workers = [], cluster.start_workers

    def start_workers(*args):
        started.extend(real_start_workers(*args))
        return started

    monkeypatch.setattr(cluster, "start_workers", start_workers)
    # 3 attention heads cannot be split over 2 ranks.
    path = make_tiny_checkpoint(
        tmp_path, "qwen3", num_attention_heads=3, num_key_value_heads=1, head_dim=16
    )
    with pytest.raises(WorkerFailure, match=r"worker rank [01] failed") as failure:
        LLM(path, tensor_parallel_size=2, dtype="float32", kv_cache_memory=64 << 20)
    assert "not divisible by tensor parallel size 2" in str(failure.value)
    assert len(started) == 2 and all(p.poll() is not None for p in started)
    assert list(ipc_dir.glob("splitserve-*")) == []  # torch may put a folder of its own there
