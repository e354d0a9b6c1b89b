"""Random admit / chunked prefill / decode / free / reset sequences against the invariants."""

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)
from kv_fakes import FakeRequest, check_invariants, free_ids, ids, snapshot

from kv_cache import AllBlocksCleared, FullAttentionManager, KVCacheManager

VOCAB = 3  # a tiny vocabulary makes shared blocks, and so cache hits, common
PREFIXES = [[], [0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0], [1, 0]]
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=12)


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 32),
        block_size=st.sampled_from([1, 2, 4]),
        enable_caching=st.booleans(),
        sliding_window=st.one_of(st.none(), st.integers(2, 10)),
        max_model_len=st.integers(4, 48),
    )
    def setup(self, num_blocks, block_size, enable_caching, sliding_window, max_model_len):
        self.manager = KVCacheManager(
            num_blocks,
            block_size,
            max_model_len,
            enable_caching=enable_caching,
            sliding_window=sliding_window,
            enable_kv_cache_events=True,
        )
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
        if any(b.is_null for b in hits.blocks):
            event("admit: cache hit padded with null blocks")
        num_new_tokens = min(chunk, request.num_tokens - num_hit_tokens)
        before = snapshot(manager)
        new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
        if new_blocks is None:
            event("admit: refused")
            assert snapshot(manager) == before
            return
        assert manager.get_block_ids(request.request_id) == ids(hits.blocks + new_blocks.blocks)
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
        manager.single_type_manager.remove_skipped_blocks(
            request.request_id, request.num_computed_tokens
        )
        held = manager.get_block_ids(request.request_id)
        self._check_window(request, held)
        if 0 in held:
            event("step: holds null blocks")
        before = snapshot(manager)
        new_blocks = manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=lookahead)
        if new_blocks is None:
            event("step: refused, preempted")
            assert snapshot(manager) == before
            self._finish(request)
            return
        assert manager.get_block_ids(request.request_id) == held + new_blocks.get_block_ids()
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
        self.manager.take_events()
        assert self.manager.reset_prefix_cache() is idle
        event(f"reset_prefix_cache: {idle}")
        if idle:
            assert not pool.cached_block_hash_to_block
            assert all(b.block_hash is None for b in pool.blocks)
            assert self.manager.take_events() == [AllBlocksCleared()]

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

    def _check_hits(self, request, hits, num_hit_tokens):
        manager = self.manager
        assert num_hit_tokens == len(hits) * manager.block_size <= request.num_tokens - 1
        if not manager.enable_caching:
            assert not hits
        for block, block_hash in zip(hits, request.block_hashes, strict=False):
            assert block.is_null or block.block_hash == block_hash
        if isinstance(manager.single_type_manager, FullAttentionManager):
            assert not any(b.is_null for b in hits)
            max_hits = (request.num_tokens - 1) // manager.block_size
            if manager.enable_caching and len(hits) < max_hits:
                missed = request.block_hashes[len(hits)]
                assert missed not in manager.block_pool.cached_block_hash_to_block

    def _check_window(self, request, block_ids):
        """Exactly the blocks wholly before the next token's window are null."""
        window = getattr(self.manager.single_type_manager, "sliding_window", None)
        num_skipped_tokens = max(0, request.num_computed_tokens - window + 1) if window else 0
        num_null = min(num_skipped_tokens // self.manager.block_size, len(block_ids))
        assert [i == 0 for i in block_ids] == [i < num_null for i in range(len(block_ids))]

    def _after_step(self, request, token_id=0):
        """A finished prefill or decode step samples a token, or ends at max_model_len."""
        if request.num_computed_tokens < request.num_tokens:
            return
        if request.num_tokens >= self.manager.max_model_len:
            self._finish(request)
        else:
            request.append_token(token_id)

    def _finish(self, request):
        """Free a request; its blocks nobody else holds join the queue tail, last block first."""
        blocks = self.manager.single_type_manager.req_to_blocks.get(request.request_id, [])
        released = [b.block_id for b in reversed(blocks) if not b.is_null and b.ref_cnt == 1]
        self.manager.free(request)
        free = free_ids(self.manager)
        assert free[len(free) - len(released) :] == released
        del self.running[request.request_id]


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_kv_cache_state_machine = KVCacheMachine.TestCase
