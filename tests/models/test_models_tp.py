"""Tensor parallelism: 2 gloo processes give the TP=1 logits, on every rank."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from ipc.sockets import free_tcp_port
from tests.models.tiny import make_tiny_checkpoint

PROMPT = torch.tensor([256, 5, 77, 3, 200, 287, 12, 12, 9, 41, 160, 7, 99, 1, 250, 30, 31])

CASES = {
    "qwen3": ("qwen3", {}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    # num_key_value_heads=1 < tp=2: the kv head is replicated on both ranks
    "llama-mqa-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "qwen3-mqa-sliding": (
        "qwen3",
        {
            "num_key_value_heads": 1,
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 1,
        },
    ),
    "mistral-mqa": ("mistral", {"num_key_value_heads": 1}),
    "gemma3-softcap": ("gemma3", {"final_logit_softcapping": 2.0}),
}


def _tp_worker(rank: int, world_size: int, port: int, paths: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    from models import load_model, parallel_state

    try:
        parallel_state.init_distributed(rank, world_size, f"tcp://127.0.0.1:{port}")
        assert parallel_state.get_tp_rank() == rank
        assert parallel_state.get_tp_size() == world_size
        # collectives
        x = torch.full((2, 3), float(rank + 1))
        torch.testing.assert_close(parallel_state.tp_all_reduce(x.clone()), torch.full((2, 3), 3.0))
        gathered = parallel_state.tp_all_gather(x, dim=-1)
        torch.testing.assert_close(gathered, torch.cat([x * 0 + 1, x * 0 + 2], dim=-1))
        torch.testing.assert_close(
            parallel_state.tp_all_gather(x, dim=0), torch.cat([x * 0 + 1, x * 0 + 2])
        )
        b = parallel_state.tp_broadcast(x.clone(), src=1)
        torch.testing.assert_close(b, torch.full((2, 3), 2.0))
        bf = parallel_state.tp_all_reduce(torch.ones(4, dtype=torch.bfloat16))
        assert bf.dtype == torch.bfloat16 and bf.tolist() == [2.0] * 4

        for case, path in paths.items():
            model = load_model(path, torch.float32)
            layers = model.attention_layers()
            info = [(a.spec.num_heads, a.spec.num_kv_heads, a.spec.sliding_window) for a in layers]
            with torch.no_grad():
                logits = model.compute_logits(model(PROMPT, torch.arange(len(PROMPT))))
                # bf16: on AMX CPUs the shards' linear layers run the packed-weight kernel
                bf16 = load_model(path, torch.bfloat16)
                bf16_logits = bf16.compute_logits(bf16(PROMPT, torch.arange(len(PROMPT))))
            packed = [m for m in bf16.modules() if getattr(m, "packed_weight", None) is not None]
            torch.save(
                {"logits": logits, "attn": info, "bf16": bf16_logits, "packed": len(packed)},
                os.path.join(out_dir, f"{case}.rank{rank}.pt"),
            )
        torch.distributed.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        parallel_state.destroy_distributed()
    # As launch.py's workers do: skip the interpreter's teardown, where torch.distributed's
    # C++ threads now and then abort (SIGABRT) a process that already finished cleanly.
    os._exit(0)


@pytest.mark.gpus(2)
def test_tp2_matches_tp1(tmp_path):
    from kernels import KernelSet
    from models import kv_cache_shape_info, layer_sliding_windows, load_config, load_model
    from models.layers.cpu_linear import linear_kernel

    paths = {
        case: make_tiny_checkpoint(tmp_path, arch, name=case, **overrides)
        for case, (arch, overrides) in CASES.items()
    }
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    mp.spawn(_tp_worker, args=(2, free_tcp_port(count=1), paths, str(out_dir)), nprocs=2, join=True)

    for case, path in paths.items():
        model = load_model(path, torch.float32)
        bf16 = load_model(path, torch.bfloat16)
        for module in bf16.modules():  # the reference: F.linear everywhere
            if hasattr(module, "packed_weight"):
                module.packed_weight = None
        with torch.no_grad():
            expected = model.compute_logits(model(PROMPT, torch.arange(len(PROMPT))))
            expected_bf16 = bf16.compute_logits(bf16(PROMPT, torch.arange(len(PROMPT))))
        config = load_config(path)
        num_layers, kv_per_rank, head_dim = kv_cache_shape_info(config, 2)
        for rank in range(2):
            got = torch.load(out_dir / f"{case}.rank{rank}.pt")
            assert got["logits"].shape == expected.shape == (len(PROMPT), 288)
            torch.testing.assert_close(got["logits"], expected, atol=1e-4, rtol=1e-4)
            # bf16 (partial sums all-reduced in bf16) about as far from float32 as tp 1's
            assert got["packed"] > 0 or linear_kernel(KernelSet.for_device("cpu")) is None
            bf16_error = (expected_bf16.float() - expected).abs().max()
            assert (got["bf16"].float() - expected).abs().max() <= 2 * bf16_error + 1e-3
            assert len(got["attn"]) == num_layers
            for num_heads, num_kv_heads, _ in got["attn"]:
                assert num_heads == 2
                assert num_kv_heads == kv_per_rank
            assert head_dim == 16
        windows = [w for _, _, w in got["attn"]]
        assert windows == layer_sliding_windows(config)
        if case == "qwen3-mqa-sliding":
            assert windows == [None, 4]
        if case == "mistral-mqa":
            assert windows == [8, 8]
        if case == "gemma3-softcap":
            assert windows == [8, 8, 8, 8, 8, None]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
