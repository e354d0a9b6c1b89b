"""Random scheduling steps over a device pool and a host tier: admit, prefill/decode, preempt
by swap or by recompute, resume, abort; take_block_copies ends each step.

Besides the ref-count invariants of both pools, a content oracle models what every block
holds: a slot holds the KV of one token, named (group, token ids up to and including it).
At the end of a step the copies are applied in the workers' order (every swap-out, then
every swap-in) and then the forward writes the scheduled tokens; every block a request
holds must then hold that request's tokens for its position. Wrong pairs, a wrong order or
a hit on stale data all show up as a slot holding the wrong tokens.

Like the scheduler, the machine never preempts, swaps or aborts a request it scheduled in
the current step, and resumes a swapped request only in a later step.
"""

from collections import Counter
from itertools import pairwise

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_fakes import FakeRequest, check_invariants, ids, snapshot
from kv_strategies import PREFIXES, VOCAB, group_layouts, tokens

from kv_cache import KVCacheManager


class HostTierMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 20),
        num_host_blocks=st.integers(2, 24),
        block_size=st.sampled_from([1, 2, 4]),
        enable_caching=st.booleans(),
        groups=group_layouts(),
        max_model_len=st.integers(4, 40),
    )
    def setup(
        self,
        num_blocks,
        num_host_blocks,
        block_size,
        enable_caching,
        groups,
        max_model_len,
    ):
        layout, group_windows = groups
        self.manager = KVCacheManager(
            num_blocks,
            block_size,
            max_model_len,
            enable_caching=enable_caching,
            group_windows=group_windows,
            num_host_blocks=num_host_blocks,
        )
        event(f"layout: {layout}")
        self.running: dict[str, FakeRequest] = {}
        self.swapped: dict[str, FakeRequest] = {}
        self.waiting: list[FakeRequest] = []  # preempted by recompute
        self.num_admitted = 0
        self.num_spilled = 0
        self.num_steps = 0
        self.past_prompts = list(PREFIXES)
        # This step: tokens each scheduled request computes, requests swapped out, and the
        # host blocks of requests resumed (held until the copies are taken).
        self.scheduled: dict[str, tuple[int, int]] = {}
        self.swapped_this_step: set[str] = set()
        self.resumed_host_blocks: list[int] = []
        # The content oracle: block id -> one entry per slot.
        self.device_content: dict[int, list] = {}
        self.host_content: dict[int, list] = {}

    # Rules ---------------------------------------------------------------------------------

    @rule(data=st.data(), suffix=tokens, chunk=st.integers(1, 16), from_waiting=st.booleans())
    def admit(self, data, suffix, chunk, from_waiting):
        """A new request (often extending an earlier prompt), or one preempted by recompute."""
        manager = self.manager
        if from_waiting and self.waiting:
            request = self.waiting.pop(0)
        else:
            prefix = data.draw(st.sampled_from(self.past_prompts))
            token_ids = (prefix + suffix)[: manager.max_model_len] or [0]
            self.past_prompts.append(token_ids)
            request = FakeRequest(f"r{self.num_admitted}", token_ids, manager.block_size)
            self.num_admitted += 1
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        if any(b.is_host for group_hits in hits.blocks for b in group_hits):
            event("admit: host-tier hit")
        num_new = min(chunk, request.num_tokens - num_hit_tokens)
        if not self._allocate(request, num_new, num_hit_tokens, hits):
            if request.request_id.startswith("r") and request.num_computed_tokens == 0:
                self.waiting.append(request)
            return
        self.running[request.request_id] = request

    @precondition(lambda self: self._idle_running())
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def schedule_running(self, data, chunk):
        """A prefill chunk or a decode step of a request not yet scheduled this step."""
        request = self._pick(data, self._idle_running())
        if request is None:
            return
        for stm in self.manager.single_type_managers:
            stm.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        self._allocate(request, num_new, 0, None)

    @precondition(lambda self: self._idle_running())
    @rule(data=st.data(), by_swap=st.booleans())
    def preempt(self, data, by_swap):
        request = self._pick(data, self._idle_running())
        if request is None:
            return
        manager = self.manager
        if by_swap:
            before = self._snapshot()
            if manager.swap_out(request):
                event("preempt: swapped out")
                del self.running[request.request_id]
                self.swapped[request.request_id] = request
                self.swapped_this_step.add(request.request_id)
                return
            event("preempt: swap refused")
            assert self._snapshot() == before
        manager.free(request)
        del self.running[request.request_id]
        request.num_computed_tokens = 0
        self.waiting.append(request)

    @precondition(lambda self: set(self.swapped) - self.swapped_this_step)
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def resume(self, data, chunk):
        candidates = [
            r for r in self.swapped.values() if r.request_id not in self.swapped_this_step
        ]
        request = self._pick(data, candidates)
        if request is None:
            return
        manager = self.manager
        blocks, num_tokens = manager.get_swapped_blocks(request)
        assert num_tokens == request.num_computed_tokens
        host_block_ids = [b.block_id for group in blocks.blocks for b in group if not b.is_null]
        request.num_computed_tokens = 0
        num_new = min(chunk, request.num_tokens - num_tokens)
        if not self._allocate(request, num_new, num_tokens, blocks):
            request.num_computed_tokens = num_tokens
            event("resume: refused")
            return
        event("resume")
        assert not manager.is_swapped(request.request_id)
        del self.swapped[request.request_id]
        self.running[request.request_id] = request
        self.resumed_host_blocks += host_block_ids

    @precondition(lambda self: self.running or self.swapped)
    @rule(data=st.data())
    def abort(self, data):
        request = self._pick(data, self._idle_running() + list(self.swapped.values()))
        if request is None:
            return
        if request.request_id in self.swapped:
            event("abort: while swapped")
        self.manager.free(request)
        self.running.pop(request.request_id, None)
        self.swapped.pop(request.request_id, None)
        assert not self.manager.is_swapped(request.request_id)

    @rule()
    def end_step(self):
        """take_block_copies, the workers' copies in their order, the forward, new tokens."""
        self.num_steps += 1
        manager = self.manager
        tier = manager.host_tier
        if tier.num_spilled_blocks > self.num_spilled:
            event("step: spilled")
        self.num_spilled = tier.num_spilled_blocks
        if any(tier.pool.blocks[h].cache_key for h, _ in tier.swap_in_copies):
            event("step: swap-in of a cached host block")
        swap_out, swap_in = manager.take_block_copies()
        self._check_copies(swap_out, swap_in)
        for device_id, host_id in swap_out:
            self.host_content[host_id] = list(self.device_content.get(device_id, []))
        for host_id, device_id in swap_in:
            self.device_content[device_id] = list(self.host_content.get(host_id, []))
        for request_id, (start, end) in self.scheduled.items():
            self._forward(self.running[request_id], start, end)
        finished = []
        for request_id in self.scheduled:
            request = self.running[request_id]
            if request.num_computed_tokens < request.num_tokens:
                continue
            if request.num_tokens >= self.manager.max_model_len:
                finished.append(request)
            else:
                request.append_token(request.num_tokens % VOCAB)
        self.scheduled.clear()
        self.swapped_this_step.clear()
        self.resumed_host_blocks.clear()
        self._check_contents()
        for request in finished:
            self.manager.free(request)
            del self.running[request.request_id]

    @rule(really=st.integers(0, 3))
    def reset_prefix_cache(self, really):
        if really:
            return
        pools = (self.manager.block_pool, self.manager.host_block_pool)
        idle = all(pool.get_num_free_blocks() == pool.num_blocks - 1 for pool in pools)
        assert self.manager.reset_prefix_cache() is idle
        if idle:
            event("reset_prefix_cache: done")
            assert all(b.cache_key is None for pool in pools for b in pool.blocks)

    # Invariants --------------------------------------------------------------------------

    @invariant()
    def device_pool_invariants(self):
        check_invariants(self.manager, self.running)

    @invariant()
    def host_pool_invariants(self):
        manager = self.manager
        tier = manager.host_tier
        pool = manager.host_block_pool
        assert set(tier.swapped) == set(self.swapped)
        for request_id, request in self.swapped.items():
            entry = tier.swapped[request_id]
            assert entry.num_tokens == request.num_computed_tokens
            num_positions = -(-entry.num_tokens // manager.block_size)
            assert all(len(blocks) == num_positions for blocks in entry.tables)
        holders: Counter[int] = Counter()
        for entry in tier.swapped.values():
            holders.update(b.block_id for blocks in entry.tables for b in blocks if not b.is_null)
        holders.update(host_id for _, host_id in tier.swap_out_copies)
        holders.update(host_id for host_id, _ in tier.swap_in_copies)
        holders.update(self.resumed_host_blocks)
        self._check_copies(tier.swap_out_copies, tier.swap_in_copies)

        queue = pool.free_block_queue
        free = queue.get_all_free_blocks()
        assert len(free) == queue.num_free_blocks
        for prev, block in pairwise(free):
            assert prev.next_free_block is block and block.prev_free_block is prev
        free_set = set(ids(free))
        assert pool.null_block is pool.blocks[0] and pool.null_block.ref_cnt == 0
        for block in pool.blocks[1:]:
            assert block.is_host and not block.is_null
            assert block.ref_cnt == holders[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in free_set)
        num_keyed = sum(b.cache_key is not None for b in pool.blocks)
        assert num_keyed == sum(len(d) for d in pool.cached_block_hash_to_block.values())
        for key, same_key in pool.cached_block_hash_to_block.items():
            assert same_key and all(b.cache_key == key for b in same_key.values())
        assert abs(manager.host_usage - (1 - len(free) / (pool.num_blocks - 1))) < 1e-9

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        manager = self.manager
        event(f"steps ended: {min(self.num_steps // 5 * 5, 30)}+")
        for request in [*self.running.values(), *self.swapped.values()]:
            manager.free(request)
        manager.take_block_copies()
        for pool in (manager.block_pool, manager.host_block_pool):
            assert pool.get_num_free_blocks() == pool.num_blocks - 1
            assert all(b.ref_cnt == 0 for b in pool.blocks)

    # Helpers -----------------------------------------------------------------------------

    def _idle_running(self) -> list[FakeRequest]:
        return [r for r in self.running.values() if r.request_id not in self.scheduled]

    def _pick(self, data, requests: list[FakeRequest]) -> FakeRequest | None:
        if not requests:
            return None
        return data.draw(st.sampled_from(sorted(requests, key=lambda r: r.request_id)))

    def _snapshot(self) -> tuple:
        manager = self.manager
        host = manager.host_block_pool
        tier = manager.host_tier
        return (
            snapshot(manager),
            [(b.ref_cnt, b.cache_key) for b in host.blocks],
            ids(host.free_block_queue.get_all_free_blocks()),
            list(tier.swap_out_copies),
            list(tier.swap_in_copies),
            sorted(tier.swapped),
        )

    def _allocate(self, request, num_new, num_computed, computed_blocks) -> bool:
        """allocate_slots; on success schedule the tokens, as the scheduler advances
        num_computed_tokens at once. A refusal must change nothing."""
        before = self._snapshot()
        new_blocks = self.manager.allocate_slots(request, num_new, num_computed, computed_blocks)
        if new_blocks is None:
            assert self._snapshot() == before
            return False
        start = request.num_computed_tokens + num_computed
        self.scheduled[request.request_id] = (start, start + num_new)
        request.num_computed_tokens = start + num_new
        return True

    def _check_copies(self, swap_out, swap_in):
        host_ids = [h for _, h in swap_out] + [h for h, _ in swap_in]
        assert len(host_ids) == len(set(host_ids)), "a host block twice in one step"
        sources = [d for d, _ in swap_out]
        assert len(sources) == len(set(sources)), "a device block swapped out twice"
        assert 0 not in host_ids and 0 not in sources

    def _forward(self, request, start, end):
        bs = self.manager.block_size
        for group_id, stm in enumerate(self.manager.single_type_managers):
            blocks = stm.req_to_blocks[request.request_id]
            for position in range(start, end):
                block = blocks[position // bs]
                assert not block.is_null
                slots = self.device_content.setdefault(block.block_id, [None] * bs)
                slots[position % bs] = (group_id, tuple(request.token_ids[: position + 1]))

    def _check_contents(self):
        bs = self.manager.block_size
        for request in self.running.values():
            tables = [
                stm.req_to_blocks.get(request.request_id, [])
                for stm in self.manager.single_type_managers
            ]
            self._check_blocks(request, tables, request.num_computed_tokens, self.device_content)
        for request_id, request in self.swapped.items():
            entry = self.manager.host_tier.swapped[request_id]
            self._check_blocks(request, entry.tables, entry.num_tokens, self.host_content)
            if any(len(blocks) * bs > entry.num_tokens for blocks in entry.tables):
                event("swapped: partial last block")

    def _check_blocks(self, request, tables, num_tokens, content):
        bs = self.manager.block_size
        for group_id, blocks in enumerate(tables):
            for i, block in enumerate(blocks):
                if block.is_null:
                    continue
                slots = content.get(block.block_id, [None] * bs)
                for position in range(i * bs, min((i + 1) * bs, num_tokens)):
                    expected = (group_id, tuple(request.token_ids[: position + 1]))
                    assert slots[position % bs] == expected, (
                        f"{request.request_id} group {group_id} block {block.block_id} "
                        f"position {position}"
                    )


HostTierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=120, deadline=None
)
test_host_tier_state_machine = HostTierMachine.TestCase
