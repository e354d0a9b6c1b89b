"""Waiting queues: first come first served, or by (priority, arrival_time)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine_core.request import Request
from ipc.config import SchedulingPolicy


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, request_ids: set[str]) -> None:
        self._queue = deque(r for r in self._queue if r.request_id not in request_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest (priority, arrival_time) first; ties in insertion order. A preempted request
    keeps its key, so it goes back ahead of every later arrival of its priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, request_ids: set[str]) -> None:
        self._heap = [e for e in self._heap if e[3].request_id not in request_ids]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def make_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    return PriorityRequestQueue() if policy == SchedulingPolicy.PRIORITY else FCFSRequestQueue()
