"""Random admit / chunked prefill / decode / free / reset sequences against the invariants,
over KV cache group layouts: full attention, one sliding window, and hybrids of both."""

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)
from kv_fakes import FakeRequest, check_invariants, free_ids, snapshot
from kv_strategies import PREFIXES, VOCAB, group_layouts, tokens

from kv_cache import KVCacheManager


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 40),
        block_size=st.sampled_from([1, 2, 4]),
        enable_caching=st.booleans(),
        groups=group_layouts(),
        single_group_by_sliding_window=st.booleans(),
        max_model_len=st.integers(4, 48),
    )
    def setup(
        self,
        num_blocks,
        block_size,
        enable_caching,
        groups,
        single_group_by_sliding_window,
        max_model_len,
    ):
        layout, group_windows = groups
        if len(group_windows) == 1 and single_group_by_sliding_window:
            layout_kwargs = {"sliding_window": group_windows[0]}
        else:
            layout_kwargs = {"group_windows": group_windows}
        self.manager = KVCacheManager(
            num_blocks,
            block_size,
            max_model_len,
            enable_caching=enable_caching,
            **layout_kwargs,
        )
        assert self.manager.group_windows == tuple(group_windows)
        event(f"layout: {layout}")
        self.running: dict[str, FakeRequest] = {}
        self.num_admitted = 0
        self.past_prompts = list(PREFIXES)

    @rule(
        data=st.data(),
        suffix=tokens,
        salt=st.sampled_from([None, None, "s"]),
        chunk=st.integers(1, 16),
    )
    def admit(self, data, suffix, salt, chunk):
        """A new request, often extending a fixed or an earlier prompt so hits are common."""
        manager = self.manager
        prefix = data.draw(st.sampled_from(self.past_prompts))
        token_ids = (prefix + suffix)[: manager.max_model_len] or [0]
        self.past_prompts.append(token_ids)
        request = FakeRequest(f"r{self.num_admitted}", token_ids, manager.block_size, salt)
        self.num_admitted += 1
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        self._check_hits(request, hits.blocks, num_hit_tokens)
        event("admit: cache hit" if num_hit_tokens else "admit: no cache hit")
        if any(b.is_null for group_hits in hits.blocks for b in group_hits):
            event("admit: cache hit padded with null blocks")
        num_new_tokens = min(chunk, request.num_tokens - num_hit_tokens)
        before = snapshot(manager)
        new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
        if new_blocks is None:
            event("admit: refused")
            assert snapshot(manager) == before
            return
        assert manager.get_block_ids(request.request_id) == (hits + new_blocks).get_block_ids()
        self.running[request.request_id] = request
        request.num_computed_tokens = num_hit_tokens + num_new_tokens
        self._after_step(request)

    @rule(
        data=st.data(),
        chunk=st.integers(1, 16),
        lookahead=st.sampled_from([0, 0, 0, 3]),
        token_id=st.integers(0, VOCAB - 1),
    )
    def step(self, data, chunk, lookahead, token_id):
        """Prefill chunk or decode step of a running request; preempt it when refused."""
        if not self.running:
            return
        manager = self.manager
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        num_new_tokens = min(chunk, request.num_tokens - request.num_computed_tokens)
        # Dropping out-of-window blocks is the one thing a refusal may do; do it up front so
        # the snapshot comparison below is exact.
        for stm in manager.single_type_managers:
            stm.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        held = manager.get_block_ids(request.request_id)
        self._check_window(request, held)
        before = snapshot(manager)
        new_blocks = manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=lookahead)
        if new_blocks is None:
            event("step: refused, preempted")
            assert snapshot(manager) == before
            self._finish(request)
            return
        assert manager.get_block_ids(request.request_id) == [
            old + new for old, new in zip(held, new_blocks.get_block_ids(), strict=True)
        ]
        request.num_computed_tokens += num_new_tokens
        self._after_step(request, token_id)

    @rule(data=st.data())
    def free(self, data):
        if not self.running:
            return
        self._finish(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    @rule(really=st.integers(0, 3))
    def reset_prefix_cache(self, really):
        if really:  # a rare event, or the cache would hardly ever hold anything
            return
        pool = self.manager.block_pool
        idle = pool.get_num_free_blocks() == pool.num_blocks - 1
        assert self.manager.reset_prefix_cache() is idle
        event(f"reset_prefix_cache: {idle}")
        if idle:
            assert not pool.cached_block_hash_to_block
            assert all(b.block_hash is None for b in pool.blocks)

    @invariant()
    def invariants(self):
        check_invariants(self.manager, self.running)

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for request in list(self.running.values()):
            self._finish(request)
        pool = self.manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert self.manager.usage == 0.0

    def _first_needed_block(self, window, num_tokens):
        """First block the token at position num_tokens attends to (window None: block 0)."""
        if window is None:
            return 0
        return max(0, num_tokens - window + 1) // self.manager.block_size

    def _group_accepts(self, request, group_id, num_blocks):
        """Whether the cache can serve the first num_blocks blocks to this group: it must hold
        every block the next token attends to."""
        bs = self.manager.block_size
        first = self._first_needed_block(self.manager.group_windows[group_id], num_blocks * bs)
        cache = self.manager.block_pool.cached_block_hash_to_block
        return all((request.block_hashes[i], group_id) in cache for i in range(first, num_blocks))

    def _check_hits(self, request, hits, num_hit_tokens):
        """The hit is the longest whole-block prefix that every group accepts, below the last
        token, with nulls exactly before each sliding group's window."""
        manager = self.manager
        bs = manager.block_size
        assert len(hits) == manager.num_groups
        num_blocks = len(hits[0])
        assert all(len(group_hits) == num_blocks for group_hits in hits)
        assert num_hit_tokens == num_blocks * bs <= request.num_tokens - 1
        if not manager.enable_caching:
            assert num_blocks == 0
            return
        groups = range(manager.num_groups)
        accepted = [
            n
            for n in range((request.num_tokens - 1) // bs + 1)
            if all(self._group_accepts(request, g, n) for g in groups)
        ]
        assert num_blocks == max(accepted)
        for group_id, group_hits in enumerate(hits):
            window = manager.group_windows[group_id]
            num_null = self._first_needed_block(window, num_hit_tokens)
            for i, block in enumerate(group_hits):
                if i < num_null:
                    assert block.is_null
                else:
                    assert block.cache_key == (request.block_hashes[i], group_id)
        longer = num_blocks + 1
        if None in manager.group_windows and longer * bs < request.num_tokens:
            full_group = manager.group_windows.index(None)
            if self._group_accepts(request, full_group, longer):
                event("admit: hit cut back by a sliding group")

    def _check_window(self, request, block_ids):
        """In each group exactly the blocks wholly before the next token's window are null."""
        for window, group_ids in zip(self.manager.group_windows, block_ids, strict=True):
            num_null = self._first_needed_block(window, request.num_computed_tokens)
            num_null = min(num_null, len(group_ids))
            assert [i == 0 for i in group_ids] == [i < num_null for i in range(len(group_ids))]
            if num_null:
                event("step: holds null blocks")

    def _after_step(self, request, token_id=0):
        """A finished prefill or decode step samples a token, or ends at max_model_len."""
        if request.num_computed_tokens < request.num_tokens:
            return
        if request.num_tokens >= self.manager.max_model_len:
            self._finish(request)
        else:
            request.append_token(token_id)

    def _finish(self, request):
        """Free a request; its blocks nobody else holds join the queue tail, from the last
        position to the first, every group's block of a position before the previous one."""
        tables = [
            stm.req_to_blocks.get(request.request_id, [])
            for stm in self.manager.single_type_managers
        ]
        released = [
            blocks[i].block_id
            for i in reversed(range(len(tables[0])))
            for blocks in tables
            if not blocks[i].is_null and blocks[i].ref_cnt == 1
        ]
        self.manager.free(request)
        free = free_ids(self.manager)
        assert free[len(free) - len(released) :] == released
        del self.running[request.request_id]


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_kv_cache_state_machine = KVCacheMachine.TestCase
