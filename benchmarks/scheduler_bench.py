"""Scheduler cost per decode step, and the size of the decode-step SchedulerOutput.

N requests with prompts of `context` tokens are prefilled, then every step decodes one
token for each of them with stand-in model outputs. Timed: schedule() plus
update_from_output() (building the stand-in output is not timed). Sizes are of the
msgpack-encoded SchedulerOutput: a plain decode step, and a step where every request
crosses a block boundary (all prompts have the same length, so they cross together).

    python -m benchmarks.scheduler_bench [--steps 64] [--requests 64 256 1024]
"""

import argparse
import statistics
import time

from engine_core import EngineConfig, Request, SamplingParams, Scheduler
from ipc.messages import ModelRunnerOutput, SchedulerOutput, encode
from ipc.utils import cdiv
from kv_cache import KVCacheManager

BLOCK_SIZE = 16
TOKEN = 11


def stand_in_output(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(scheduler_output.step_id, req_ids, [[TOKEN]] * len(req_ids))


def prefilled_scheduler(num_requests: int, context: int, num_steps: int) -> Scheduler:
    max_model_len = context + num_steps + 2
    config = EngineConfig(
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        max_num_seqs=num_requests,
        max_num_batched_tokens=num_requests * context,
    )
    num_blocks = num_requests * cdiv(max_model_len, BLOCK_SIZE) + 1
    scheduler = Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, max_model_len))
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(num_requests):
        prompt = [i] + [100 + t % 1000 for t in range(context - 1)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, arrival_time=float(i)))
    scheduler_output = scheduler.schedule()
    scheduler.update_from_output(scheduler_output, stand_in_output(scheduler_output))
    assert len(scheduler.running) == num_requests and not scheduler.waiting
    return scheduler


def bench(num_requests: int, context: int, num_steps: int) -> dict:
    scheduler = prefilled_scheduler(num_requests, context, num_steps)
    step_seconds, sizes = [], []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        scheduler_output = scheduler.schedule()
        t1 = time.perf_counter()
        model_runner_output = stand_in_output(scheduler_output)
        t2 = time.perf_counter()
        outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
        t3 = time.perf_counter()
        assert scheduler_output.total_num_scheduled_tokens == num_requests
        assert len(outputs.outputs) == num_requests
        step_seconds.append(t1 - t0 + t3 - t2)
        sizes.append(len(encode(scheduler_output)))
    step_us = statistics.median(step_seconds) * 1e6
    return {
        "step_us": step_us,
        "per_request_us": step_us / num_requests,
        "plain_bytes": min(sizes),
        "block_bytes": max(sizes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per case")
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    args = parser.parse_args()
    print(f"block_size={BLOCK_SIZE}, {args.steps} decode steps per case (median step time)")
    print(
        f"{'running':>8} {'context':>8} {'µs/step':>10} {'µs/request':>11} "
        f"{'bytes/step':>11} {'bytes/step +block':>18}"
    )
    for context in args.contexts:
        for num_requests in args.requests:
            r = bench(num_requests, context, args.steps)
            print(
                f"{num_requests:>8} {context:>8} {r['step_us']:>10.0f} "
                f"{r['per_request_us']:>11.2f} {r['plain_bytes']:>11} {r['block_bytes']:>18}"
            )


if __name__ == "__main__":
    main()
