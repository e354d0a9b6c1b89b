"""Hand-made SchedulerOutputs for the tests that drive a ModelRunner."""

from collections.abc import Sequence

from ipc.messages import CachedRequestData, NewRequestData, SchedulerOutput


def runner_step(
    step_id: int,
    new: Sequence[NewRequestData] = (),
    cached: CachedRequestData | None = None,
    scheduled: dict[str, int] | None = None,
    finished: Sequence[str] = (),
) -> SchedulerOutput:
    """Step `step_id` of the `new` and the `cached` requests, with `scheduled` tokens per
    request (by default each new request's whole prompt), finishing `finished`."""
    scheduled = scheduled or {r.req_id: len(r.prompt_token_ids) for r in new}
    return SchedulerOutput(
        step_id,
        list(new),
        cached or CachedRequestData(),
        scheduled,
        sum(scheduled.values()),
        list(finished),
    )


def decoding(num_computed: dict[str, int], num_groups: int = 1) -> CachedRequestData:
    """Running requests (id -> tokens computed) that get no new blocks in any of the
    `num_groups` KV cache groups."""
    ids = list(num_computed)
    return CachedRequestData(
        ids,
        [False] * len(ids),
        [[] for _ in ids],
        [[[]] * num_groups for _ in ids],
        [*num_computed.values()],
    )
