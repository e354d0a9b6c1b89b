"""The fused CPU kernels of models/layers (cpu_ops.cpp) against their torch code.

    python benchmarks/elementwise_bench.py [--threads 2] [--tokens 256 8192] [--model PATH]

Times each op at SmolLM2-135M's shapes (hidden 576, 9 heads, 3 kv heads, head_dim 64,
intermediate 1536, bf16), torch path and kernel in the same process, best of several
runs; then, with --model, steps of the in-process engine (a prefill step of 8,192 tokens,
decode steps with 256 requests running) with the layers' fused kernels off (as a kernel set
with SPLITSERVE_CPU_KERNELS=0 has them) and on, taking turns.
"""

import argparse
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import KernelSet  # noqa: E402
from models.layers.activation import SiluAndMul  # noqa: E402
from models.layers.fused_ops import fused_ops  # noqa: E402
from models.layers.norm import RMSNorm  # noqa: E402
from models.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536
DTYPE = torch.bfloat16


def best_times(fns: list[Callable[[], object]], runs: int, min_run_s: float) -> list[float]:
    """Seconds per call of each fn: the best of `runs` runs of enough calls to last about
    min_run_s, the fns taking turns (so that a busy spell on a shared box hits them alike)."""
    calls = []
    for fn in fns:
        fn()
        count, start = 0, time.perf_counter()
        while count == 0 or time.perf_counter() - start < min_run_s:
            fn()
            count += 1
        calls.append(count)
    best = [float("inf")] * len(fns)
    for _ in range(runs):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(calls[i]):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls[i])
    return best


def op_cases(tokens: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name -> (torch path, kernel path) at `tokens` tokens."""
    ops = fused_ops(KernelSet(cpu=True))
    norm, head_norm = RMSNorm(HIDDEN, eps=1e-5), RMSNorm(HEAD_DIM, eps=1e-5)
    for layer in (norm, head_norm):
        layer.weight.data = torch.randn(layer.hidden_size).to(DTYPE)
    x, residual = torch.randn(tokens, HIDDEN, dtype=DTYPE), torch.randn(tokens, HIDDEN, dtype=DTYPE)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(tokens, q_size + 2 * kv_size, dtype=DTYPE)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    heads = q.reshape(tokens, HEADS, HEAD_DIM)  # a strided view, as Qwen3's q_norm gets it
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    rope = RotaryEmbedding(HEAD_DIM, 8192, inv_freq)
    positions = torch.arange(tokens)
    cos, sin = rope.get_cos_sin(positions, DTYPE)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=DTYPE)
    act = SiluAndMul()
    for layer in (norm, head_norm, act):
        layer.ops = ops
    x_own, residual_own = x.clone(), residual.clone()  # for the in-place kernel to overwrite
    return {
        "rms_norm": (lambda: norm.forward_torch(x), lambda: norm(x)),
        "add_rms_norm": (lambda: norm.forward_torch(x, residual), lambda: norm(x, residual)),
        "add_rms_norm, in place": (
            lambda: norm.forward_torch(x, residual),
            lambda: norm(x_own, residual_own, in_place=True),
        ),
        "q_norm per head (Qwen3)": (
            lambda: head_norm.forward_torch(heads),
            lambda: head_norm(heads),
        ),
        "rotary q+k": (
            lambda: (apply_rotary(q, cos, sin, HEAD_DIM), apply_rotary(k, cos, sin, HEAD_DIM)),
            lambda: ops.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache, HEAD_DIM),
        ),
        "silu_and_mul": (lambda: act.forward_torch(gate_up), lambda: act(gate_up)),
    }


def report(name: str, t_torch: float, t_kernel: float) -> None:
    print(f"{name}{t_torch:>12.3f}{t_kernel:>12.3f}{t_torch / t_kernel:>8.2f}x")


def bench_ops(tokens_list: list[int], runs: int) -> None:
    print(f"{'op':<36}{'T':>6}{'torch us':>12}{'kernel us':>12}{'speedup':>9}")
    for tokens in tokens_list:
        for name, (torch_fn, kernel_fn) in op_cases(tokens).items():
            t_torch, t_kernel = best_times([torch_fn, kernel_fn], runs, min_run_s=0.02)
            report(f"{name:<36}{tokens:>6}", t_torch * 1e6, t_kernel * 1e6)


def with_fused_ops(model: torch.nn.Module, ops: object, fn: Callable[[], object]) -> object:
    """fn() with the model's norm, activation and rotary layers on `ops` (None: torch)."""
    for module in model.modules():
        if hasattr(type(module), "ops"):
            module.ops = ops
    return fn()


def bench_engine(model_path: str, runs: int) -> None:
    """Steps of the in-process engine (bf16, prefix caching off), the kernels off and on
    taking turns: a prefill step of 8 prompts of 1024 tokens, and decode steps with 256
    requests running."""
    from ipc.messages import EngineCoreRequest
    from ipc.sampling_params import SamplingParams
    from splitserve import LLM

    engine = LLM(
        model_path,
        dtype="bfloat16",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        enable_prefix_caching=False,
        kv_cache_memory=2 << 30,
    ).engine
    model = engine.executor.runner.model
    on = partial(with_fused_ops, model, fused_ops(KernelSet(cpu=True)))
    off = partial(with_fused_ops, model, None)
    rng, ids = random.Random(0), iter(range(1 << 30))

    def add(num_prompts: int, length: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for _ in range(num_prompts):
            prompt = [rng.randrange(10_000) for _ in range(length)]
            engine.add_request(EngineCoreRequest(str(next(ids)), prompt, params, time.time()))

    def prefill() -> None:
        add(8, 1024, 1)
        while engine.has_unfinished_requests():
            engine.step()

    print(f"\nengine steps, {Path(model_path).name}, bf16, in process")
    print(f"{'step':<42}{'torch s':>12}{'kernels s':>12}{'speedup':>9}")
    times = best_times([partial(off, prefill), partial(on, prefill)], runs, 0)
    report(f"{'prefill, 8 x 1024 tokens':<42}", *times)
    decode_runs = 10 * runs  # one step a run: steps are short, and noisy on a shared box
    add(256, 32, 2 * decode_runs + 8)
    engine.step()  # their prefill
    steps = [partial(off, engine.step), partial(on, engine.step)]
    report(f"{'decode, 256 running':<42}", *best_times(steps, decode_runs, 0))
    engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 8192])
    parser.add_argument("--runs", type=int, default=15, help="best of this many runs")
    parser.add_argument("--model", help="also time engine steps of this HF folder")
    parser.add_argument("--model-runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if fused_ops(KernelSet(cpu=True)) is None:
        sys.exit("the C++ kernels could not be built")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {DTYPE}")
    bench_ops(args.tokens, args.runs)
    if args.model:
        bench_engine(args.model, args.model_runs)


if __name__ == "__main__":
    main()
