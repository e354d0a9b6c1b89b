"""Throughput, nano-vllm style: N requests of random token ids (below 10,000), prompt
lengths uniform in [100, 512], output lengths uniform in [100, 256] with ignore_eos,
temperature 0.6, after one warm-up request. Reports output and total token throughput,
and the EngineCore's time per step: schedule, broadcast (encode + send to the workers;
0 in-process), update_from_output, against the wait for the model.

    python -m benchmarks.throughput_bench --mode llm [--model M] [--tp N] [--dtype D]
    python -m benchmarks.throughput_bench --address ADDR_OR_FILE   # a running launch.py
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import time

from engine_core.engine_proc import StepProfile
from ipc.messages import SamplingParams, SchedulerStats

Workload = list[tuple[list[int], SamplingParams]]


def make_workload(num_requests: int, seed: int) -> Workload:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(10_000) for _ in range(rng.randint(100, 512))],
            SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 256)),
        )
        for _ in range(num_requests)
    ]


def run_llm(args: argparse.Namespace, workload: Workload) -> tuple[float, int, StepProfile]:
    from splitserve import LLM

    llm = LLM(args.model, dtype=args.dtype, tensor_parallel_size=args.tp)
    llm.generate([1, 2, 3], SamplingParams(max_tokens=8), use_tqdm=False)
    profile = _instrument(llm.engine)
    prompts, params = zip(*workload, strict=True)
    start = time.perf_counter()
    outputs = llm.generate(list(prompts), list(params), use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs), profile


def _instrument(engine) -> StepProfile:
    """Time engine.step by phase, as the EngineCore process does; an in-process executor
    gets the (called, sent, answered) times MultiprocExecutor records itself."""
    executor = engine.executor
    if not hasattr(executor, "last_call"):
        execute_model = executor.execute_model

        def timed_execute_model(scheduler_output):
            start = time.perf_counter()
            output = execute_model(scheduler_output)
            executor.last_call = (start, start, time.perf_counter())
            return output

        executor.execute_model = timed_execute_model
    profile = StepProfile()
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
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("llm", "client"), default="llm")
    parser.add_argument("--address", help="engine address or address file (implies client)")
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct (llm mode)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (llm mode)")
    parser.add_argument("--dtype", default="auto", help="llm mode")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workload = make_workload(args.num_requests, args.seed)
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


if __name__ == "__main__":
    main()
