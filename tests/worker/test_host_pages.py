import gc
import os
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import worker.host_pages
from kernels.huge_pages import zeros_on_huge_pages
from worker.host_pages import FaultInBehind

MiB = 1 << 20


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_fault_in_behind_makes_the_pages_resident_and_keeps_what_was_written():
    """The thread faults in the untouched pages; what a step wrote before it got there (and
    the zeros elsewhere) stay as they are: the advice never rewrites a page."""
    before = _resident_bytes()
    cache = zeros_on_huge_pages((2, 32 * MiB + 12345), torch.uint8)
    assert _resident_bytes() - before < 16 * MiB  # nothing touched yet
    cache[0, 5 * MiB : 5 * MiB + 100] = 3
    cache[1, -7:] = 9
    thread = FaultInBehind([cache]).thread
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert _resident_bytes() - before >= 60 * MiB
    assert cache.sum().item() == 3 * 100 + 9 * 7
    assert cache[0, 5 * MiB : 5 * MiB + 100].eq(3).all() and cache[1, -7:].eq(9).all()


def test_fault_in_at_start_makes_every_page_resident_before_it_returns():
    before = _resident_bytes()
    cache = zeros_on_huge_pages((2, 16 * MiB), torch.uint8)
    cache[1, :5] = 4
    assert FaultInBehind([cache], at_start=True).thread is None
    assert _resident_bytes() - before >= 30 * MiB
    assert cache.sum().item() == 20


def _record_populates(monkeypatch, on_call=lambda: None) -> list[tuple[int, int]]:
    calls = []

    def populate(address: int, length: int) -> bool:
        calls.append((address, length))
        on_call()
        return True

    monkeypatch.setattr(worker.host_pages, "_populate", populate)
    return calls


def test_fault_in_behind_takes_the_same_offset_of_every_slice_together(monkeypatch):
    """Two KV tensors of shape (2, blocks, ...): 2 MB of K and of V of the first, of the
    second, then the next 2 MB of each, so low block ids of every layer come first; the
    last chunk of a slice is cut at its end."""
    calls = _record_populates(monkeypatch)
    chunk = 2 * MiB
    size = 2 * chunk + 1000  # bytes a slice
    a = zeros_on_huge_pages((2, size), torch.uint8)
    b = zeros_on_huge_pages((2, size // 4), torch.float32)
    FaultInBehind([a, b]).thread.join(timeout=60)
    starts = [t.data_ptr() + i * size for t in (a, b) for i in (0, 1)]
    expected = [
        (start + offset, min(chunk, size - offset))
        for offset in (0, chunk, 2 * chunk)
        for start in starts
    ]
    assert calls == expected


def _held_in_its_first_chunk(monkeypatch):
    """A FaultInBehind over a 64 MiB tensor whose thread is in its first chunk's fault-in,
    held there until go_on is set; with the tensor and the populate calls so far."""
    faulting, go_on = threading.Event(), threading.Event()

    def hold_a_chunk():
        faulting.set()
        go_on.wait(timeout=60)

    calls = _record_populates(monkeypatch, hold_a_chunk)
    cache = zeros_on_huge_pages((1, 64 * MiB), torch.uint8)
    fault_in = FaultInBehind([cache])
    assert faulting.wait(timeout=60)
    return fault_in, cache, go_on, calls


def test_fault_in_behind_stops_when_the_tensors_are_freed_or_the_kernel_refuses(monkeypatch):
    fault_in, cache, go_on, calls = _held_in_its_first_chunk(monkeypatch)
    thread = fault_in.thread
    del cache
    gc.collect()
    go_on.set()
    thread.join(timeout=60)
    assert not thread.is_alive() and len(calls) == 1

    monkeypatch.setattr(worker.host_pages, "_populate", lambda address, length: False)
    cache = zeros_on_huge_pages((1, 64 * MiB), torch.uint8)
    thread = FaultInBehind([cache]).thread
    thread.join(timeout=60)
    assert not thread.is_alive() and cache.eq(0).all()


def test_a_stopped_fault_in_holds_no_tensor(monkeypatch):
    """stop() returns once the thread is gone, so that an engine's shutdown frees its KV
    cache at once: the thread holds a tensor while it faults in a chunk."""
    fault_in, cache, go_on, calls = _held_in_its_first_chunk(monkeypatch)
    stopper = threading.Thread(target=fault_in.stop)
    stopper.start()
    stopper.join(timeout=0.2)
    assert stopper.is_alive(), "stop() waits for the chunk in progress"
    go_on.set()
    stopper.join(timeout=60)
    assert not fault_in.thread.is_alive() and len(calls) == 1
    freed = weakref.ref(cache)
    del cache
    assert freed() is None  # no garbage collection needed
    FaultInBehind([], at_start=True).stop()  # nothing to stop


def _anon_huge_page_bytes() -> int:
    smaps = Path("/proc/self/smaps").read_text().splitlines()
    return 1024 * sum(int(line.split()[1]) for line in smaps if line.startswith("AnonHugePages:"))


def test_zeros_on_huge_pages_are_on_huge_pages_where_the_kernel_allows_them():
    """A private mapping: a shared anonymous one (mmap.mmap's default) is shmem, which gets
    no huge pages under the default shmem_enabled "never", whatever madvise says."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    before = _anon_huge_page_bytes()
    cache = zeros_on_huge_pages((64, MiB), torch.uint8)
    FaultInBehind([cache]).thread.join(timeout=120)
    assert _anon_huge_page_bytes() - before >= 32 * MiB
    del cache


def test_fault_in_behind_waits_while_a_step_runs_and_a_moment_after(monkeypatch):
    first, go_on = threading.Event(), threading.Event()
    times = []

    def populate(address: int, length: int) -> bool:
        times.append(time.monotonic())
        first.set()
        go_on.wait(timeout=60)
        return True

    monkeypatch.setattr(worker.host_pages, "_populate", populate)
    cache = zeros_on_huge_pages((1, 3 * 2 * MiB), torch.uint8)
    fault_in = FaultInBehind([cache])
    assert first.wait(timeout=60)
    with fault_in.held_off():
        go_on.set()
        time.sleep(0.3)
        assert len(times) == 1
        step_ends = time.monotonic()
    fault_in.thread.join(timeout=60)
    assert len(times) == 3 and times[1] >= step_ends + worker.host_pages._QUIET_S
