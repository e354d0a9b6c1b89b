r"""Throughput, nano-vllm style: N requests of random token ids (below 10,000), prompt
lengths uniform in [100, 512], output lengths uniform in [100, 256] with ignore_eos,
temperature 0.6, after one warm-up request. Reports output and total token throughput,
and the EngineCore's time per step: schedule, broadcast (encode + send to the workers;
0 in-process), update_from_output, against the wait for the model.

    python -m benchmarks.throughput_bench --mode llm [--model M] [--tp N] [--dtype D]
    python -m benchmarks.throughput_bench --address ADDR_OR_FILE   # a running launch.py
    python -m benchmarks.throughput_bench --mode llm --baseline    # + transformers, same run
    python -m benchmarks.throughput_bench --mode llm --compare-async \
        --prompt-len 100 1024 --output-len 100 1024 --max-model-len 4096   # nano-vllm's bench

With --compare-async the workload runs through two engines one after the other, with
async scheduling off and on, and the script prints the ratio.

With --baseline the same workload also runs through transformers' `generate` (static
batches of --hf-batch-size, left-padded, sampling at the same temperature, each batch
generating its longest output) and the script prints splitserve's throughput ratio.
Only the tokens each request asked for count as output for either.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import time

from engine_core.step_profile import StepProfile
from ipc.config import DTYPES
from ipc.messages import SchedulerStats
from ipc.sampling_params import SamplingParams

Workload = list[tuple[list[int], SamplingParams]]


def make_workload(
    num_requests: int,
    seed: int,
    prompt_len: tuple[int, int] = (100, 512),
    output_len: tuple[int, int] = (100, 256),
) -> Workload:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(10_000) for _ in range(rng.randint(*prompt_len))],
            SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(*output_len)),
        )
        for _ in range(num_requests)
    ]


def run_llm(
    args: argparse.Namespace, workload: Workload, async_scheduling: bool | None = None
) -> tuple[float, int, StepProfile]:
    from splitserve import LLM

    kwargs = {
        name: value
        for name in ("max_model_len", "max_num_batched_tokens")
        if (value := getattr(args, name)) is not None
    }
    llm = LLM(
        args.model,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        async_scheduling=async_scheduling,
        **kwargs,
    )
    llm.generate([1, 2, 3], SamplingParams(max_tokens=8), use_tqdm=False)
    profile = _instrument(llm.engine)
    prompts, params = zip(*workload, strict=True)
    start = time.perf_counter()
    outputs = llm.generate(list(prompts), list(params), use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs), profile


def run_transformers(args: argparse.Namespace, workload: Workload) -> float:
    """Seconds transformers' generate takes for the workload, in static batches."""
    import torch
    from transformers import AutoModelForCausalLM

    from models import load_config, resolve_dtype
    from models.default import default_model_path

    path = args.model or default_model_path()
    dtype = resolve_dtype(args.dtype, load_config(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    def generate(batch: Workload) -> None:
        longest = max(len(prompt) for prompt, _ in batch)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch])
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(sp.max_tokens for _, sp in batch),
                do_sample=True,
                temperature=0.6,
                top_k=None,
                top_p=None,
                eos_token_id=None,
                pad_token_id=0,
            )

    generate([([1, 2, 3], SamplingParams(max_tokens=8))])
    start = time.perf_counter()
    for i in range(0, len(workload), args.hf_batch_size):
        generate(workload[i : i + args.hf_batch_size])
    return time.perf_counter() - start


def _instrument(engine) -> StepProfile:
    """Time engine.step by phase, as the EngineCore process does."""
    executor = engine.executor
    profile = StepProfile(engine_was_idle=True)  # not the wait since the warm-up
    engine.step = functools.partial(profile.timed_step, engine.step, executor)
    return profile


async def run_client(address: str, workload: Workload) -> tuple[float, int, StepProfile]:
    from ipc.client import AsyncEngineClient

    async with await AsyncEngineClient.create(address) as client:
        await client.generate([1, 2, 3], SamplingParams(max_tokens=8))
        before = await client.stats()
        start = time.perf_counter()
        outputs = await asyncio.gather(*(client.generate(p, sp) for p, sp in workload))
        elapsed = time.perf_counter() - start
        after = await client.stats()
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs), _profile(before, after)


def _profile(before: SchedulerStats, after: SchedulerStats) -> StepProfile:
    return StepProfile(
        after.num_steps - before.num_steps,
        after.schedule_time - before.schedule_time,
        after.broadcast_time - before.broadcast_time,
        after.wait_time - before.wait_time,
        after.update_time - before.update_time,
        after.worker_idle_time - before.worker_idle_time,
    )


def main() -> None:
    os.environ.setdefault("SPLITSERVE_KV_FAULT_IN", "start")  # engines compared
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("llm", "client"), default="llm")
    parser.add_argument("--address", help="engine address or address file (implies client)")
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct (llm mode)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (llm mode)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="llm mode")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(100, 512), metavar=("LO", "HI"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(100, 256), metavar=("LO", "HI"))
    parser.add_argument("--max-model-len", type=int, help="llm mode (default: the model's)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="llm mode (default: the engine's)"
    )
    parser.add_argument(
        "--compare-async", action="store_true", help="llm mode: async scheduling off, then on"
    )
    parser.add_argument("--baseline", action="store_true", help="also run transformers")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    args = parser.parse_args()
    workload = make_workload(args.num_requests, args.seed, args.prompt_len, args.output_len)
    if args.compare_async:
        if args.address or args.mode != "llm":
            parser.error("--compare-async runs engines in this process: llm mode only")
        results = {mode: run_llm(args, workload, mode) for mode in (False, True)}
        for mode, (elapsed, output_tokens, profile) in results.items():
            print(
                f"async scheduling {'on ' if mode else 'off'}: {output_tokens} output tokens in "
                f"{elapsed:.2f} s, {output_tokens / elapsed:.1f} tok/s; {profile.summary()}"
            )
        print(f"async / lockstep: {results[False][0] / results[True][0]:.3f}x")
        return
    if args.address:
        elapsed, output_tokens, profile = asyncio.run(run_client(args.address, workload))
        where = f"cluster at {args.address}"
    elif args.mode == "client":
        parser.error("--mode client needs --address")
    else:
        elapsed, output_tokens, profile = run_llm(args, workload)
        where = f"LLM (tp {args.tp}, dtype {args.dtype})"
    prompt_tokens = sum(len(prompt) for prompt, _ in workload)
    total_tokens = prompt_tokens + output_tokens
    print(
        f"{where}: {args.num_requests} requests, {prompt_tokens} prompt + "
        f"{output_tokens} output tokens in {elapsed:.2f} s"
    )
    print(
        f"output throughput {output_tokens / elapsed:.1f} tok/s, "
        f"total {total_tokens / elapsed:.1f} tok/s"
    )
    print(f"EngineCore steps: {profile.summary()}")
    if args.baseline:
        hf_elapsed = run_transformers(args, workload)
        print(
            f"transformers generate (batches of {args.hf_batch_size}): {hf_elapsed:.2f} s, "
            f"output {output_tokens / hf_elapsed:.1f} tok/s; "
            f"splitserve / transformers = {hf_elapsed / elapsed:.2f}x"
        )


if __name__ == "__main__":
    main()
