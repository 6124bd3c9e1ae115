"""KVCacheManager on CPU: exact block ids, prefix hits, the collision guard and LRU eviction order."""

from __future__ import annotations

import pytest

from engine.core.kv_cache import BlockHash, KVCacheManager, hash_block_tokens
from engine.core.request import Request
from engine.frontend.protocol import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=16))


def compute_prompt(kv: KVCacheManager, request: Request) -> None:
    """Admit a request as the scheduler would (prefix hit first) and compute its whole prompt."""
    computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit_tokens, computed_blocks)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)


def test_allocation_takes_blocks_from_the_free_queue_head_in_order():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    first, second = make_request("a", list(range(6))), make_request("b", list(range(10, 20)))
    assert kv.allocate_slots(first, 6)
    assert kv.allocate_slots(second, 10)
    assert first.block_ids == [0, 1]
    assert second.block_ids == [2, 3, 4]
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(0.5)

    # Decoding into the last block's free slot needs no new block; the token after it does.
    first.num_computed_tokens = 6
    assert kv.allocate_slots(first, 1)
    assert first.block_ids == [0, 1]
    first.num_computed_tokens = 8
    assert kv.allocate_slots(first, 1)
    assert first.block_ids == [0, 1, 5]
    assert kv.free_block_ids() == [6, 7, 8, 9]


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(9)))
    compute_prompt(kv, first)
    assert first.block_ids == [0, 1, 2]
    kv.free(first)
    # Unhashed (partial) block 2 goes to the head, cached blocks to the tail, last block first.
    assert kv.free_block_ids() == [2, 3, 1, 0]

    second = make_request("b", list(range(8)) + list(range(100, 109)))  # 17 tokens, 5 blocks
    computed_blocks, num_hit_tokens = kv.get_computed_blocks(second)
    assert (computed_blocks, num_hit_tokens) == ([0, 1], 8)
    # 2 hits + 3 new blocks: the hits sit in the free queue too, so only 2 blocks are really left.
    assert not kv.allocate_slots(second, 9, computed_blocks)
    assert second.block_ids == []
    assert kv.free_block_ids() == [2, 3, 1, 0]
    assert [kv.blocks[i].ref_cnt for i in range(4)] == [0, 0, 0, 0]
    assert kv.get_computed_blocks(second) == ([0, 1], 8)

    assert kv.allocate_slots(second, 8, computed_blocks)
    assert second.block_ids == [0, 1, 2, 3]
    assert kv.num_free_blocks == 0


def test_prefix_hit_and_miss():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(10)))
    compute_prompt(kv, first)
    assert first.block_ids == [0, 1, 2]

    same_prefix = make_request("b", list(range(8)) + [50, 51, 52])
    assert kv.get_computed_blocks(same_prefix) == ([0, 1], 8)
    assert kv.allocate_slots(same_prefix, 3, [0, 1])
    assert same_prefix.block_ids == [0, 1, 3]
    assert [kv.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]

    differs_in_block_2 = make_request("c", [0, 1, 2, 3, 4, 99, 6, 7, 8, 9])
    assert kv.get_computed_blocks(differs_in_block_2) == ([0], 4)

    differs_in_block_1 = make_request("d", [7, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(differs_in_block_1) == ([], 0)

    assert kv.prefix_queries == 10 + 11 + 10 + 10
    assert kv.prefix_hits == 0 + 8 + 4 + 0


def test_blocks_are_shared_only_between_requests_with_the_same_salt():
    """A principal's prompt is a hit for that principal alone: another one's identical prompt (or a
    guess at it) computes its own blocks, and the unsalted shared cache is a space of its own."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    tokens = list(range(9))
    alice = Request("a", tokens, SamplingParams(max_tokens=4), cache_salt="alice")
    compute_prompt(kv, alice)
    assert kv.get_computed_blocks(Request("b", tokens, SamplingParams(max_tokens=4), cache_salt="bob")) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", tokens)) == ([], 0)
    again = Request("d", tokens, SamplingParams(max_tokens=4), cache_salt="alice")
    assert kv.get_computed_blocks(again) == (alice.block_ids[:2], 8)

    shared = make_request("e", list(range(100, 109)))
    compute_prompt(kv, shared)
    assert kv.get_computed_blocks(make_request("f", list(range(100, 109)))) == (shared.block_ids[:2], 8)
    salted = Request("g", list(range(100, 109)), SamplingParams(max_tokens=4), cache_salt="alice")
    assert kv.get_computed_blocks(salted) == ([], 0)


def test_lookup_counts_a_request_once_until_it_is_freed():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    compute_prompt(kv, make_request("a", list(range(9))))
    retrying = make_request("b", list(range(9)))
    for _ in range(3):
        assert kv.get_computed_blocks(retrying) == ([0, 1], 8)
    assert (kv.prefix_queries, kv.prefix_hits) == (9 + 9, 8)


def test_a_hit_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    compute_prompt(kv, make_request("a", list(range(9))))
    # Both full blocks are cached, but an 8-token prompt must still compute its last token.
    assert kv.get_computed_blocks(make_request("b", list(range(8)))) == ([0], 4)
    assert kv.get_computed_blocks(make_request("c", list(range(9)))) == ([0, 1], 8)
    assert kv.get_computed_blocks(make_request("d", list(range(4)))) == ([], 0)


def test_a_hit_on_a_freed_block_takes_it_out_of_the_free_queue():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(9)))
    compute_prompt(kv, first)
    kv.free(first)
    assert kv.num_free_blocks == 6
    assert kv.free_block_ids() == [2, 3, 4, 5, 1, 0]

    second = make_request("b", list(range(9)))
    compute_prompt(kv, second)
    assert second.block_ids == [0, 1, 2]
    assert kv.free_block_ids() == [3, 4, 5]
    assert [kv.blocks[i].ref_cnt for i in range(3)] == [1, 1, 1]


def test_shared_blocks_stay_allocated_while_referenced():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first, second = make_request("a", list(range(9))), make_request("b", list(range(9)))
    compute_prompt(kv, first)
    compute_prompt(kv, second)
    assert (first.block_ids, second.block_ids) == ([0, 1, 2], [0, 1, 3])
    kv.free(first)
    assert first.block_ids == []
    assert kv.free_block_ids() == [2, 4, 5, 6, 7]
    kv.free(second)
    assert kv.free_block_ids() == [3, 2, 4, 5, 6, 7, 1, 0]


def test_collision_guard_compares_tokens():
    def index_only(parent: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
        # Every block at the same position collides, whatever its tokens.
        return (parent or b"") + b"#"

    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, hash_fn=index_only)
    compute_prompt(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 9, 9, 9, 9, 0])) == ([0], 4)
    assert kv.get_computed_blocks(make_request("c", [9, 9, 9, 9, 5, 6, 7, 8, 0])) == ([], 0)
    assert kv.prefix_hits == 4


def test_collision_guard_compares_parents():
    def parent_blind(parent: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
        return hash_block_tokens(None, token_ids)

    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, hash_fn=parent_blind)
    compute_prompt(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    compute_prompt(kv, make_request("b", [9, 9, 9, 9, 0]))
    # Block 1's tokens and (parent-blind) hash match request a's block 1, but its prefix differs.
    assert kv.get_computed_blocks(make_request("c", [9, 9, 9, 9, 5, 6, 7, 8, 0])) == ([3], 4)


def test_default_hash_is_chained_from_the_parent():
    tokens = (1, 2, 3, 4)
    root = hash_block_tokens(None, tokens)
    assert root == hash_block_tokens(None, tokens)
    assert hash_block_tokens(root, tokens) != root
    assert hash_block_tokens(root, tokens) != hash_block_tokens(hash_block_tokens(None, (5, 6, 7, 8)), tokens)
    assert hash_block_tokens(None, (1, 2, 3, 5)) != root


def test_lru_evicts_least_recently_freed_and_tails_before_prefixes():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first, second = make_request("a", list(range(9))), make_request("b", list(range(100, 109)))
    compute_prompt(kv, first)
    compute_prompt(kv, second)
    assert (first.block_ids, second.block_ids) == ([0, 1, 2], [3, 4, 5])
    kv.free(first)
    kv.free(second)
    # Partial blocks 5 and 2 first, the never-used 6 and 7, then a's tail 1 before its prefix 0,
    # then b's blocks, freed last.
    assert kv.free_block_ids() == [5, 2, 6, 7, 1, 0, 4, 3]

    third = make_request("c", list(range(200, 220)))  # 5 blocks
    assert kv.allocate_slots(third, 20)
    assert third.block_ids == [5, 2, 6, 7, 1]
    assert kv.get_computed_blocks(make_request("a2", list(range(9)))) == ([0], 4)
    assert kv.get_computed_blocks(make_request("b2", list(range(100, 109)))) == ([3, 4], 8)

    fourth = make_request("d", list(range(300, 302)))
    assert kv.allocate_slots(fourth, 2)
    assert fourth.block_ids == [0]
    assert kv.get_computed_blocks(make_request("a3", list(range(9)))) == ([], 0)
    assert kv.num_cached_blocks == 2


def test_blocks_are_hashed_only_after_they_are_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(10)))
    # Chunked prefill: slots for the whole prompt, but only 6 tokens computed so far.
    assert kv.allocate_slots(first, 10)
    kv.cache_blocks(first, 0)
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    first.num_computed_tokens = 6
    kv.cache_blocks(first, 6)
    assert kv.get_computed_blocks(make_request("c", list(range(10)))) == ([0], 4)
    first.num_computed_tokens = 10
    kv.cache_blocks(first, 10)
    assert kv.get_computed_blocks(make_request("d", list(range(10)))) == ([0, 1], 8)


def test_generated_tokens_become_hittable_once_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", [1, 2, 3, 4, 5, 6])
    compute_prompt(kv, first)
    longer = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    first.append_output_token(7)
    assert kv.allocate_slots(first, 1)
    first.num_computed_tokens += 1
    kv.cache_blocks(first, first.num_computed_tokens)
    assert kv.get_computed_blocks(make_request("b", longer)) == ([0], 4)
    # Token 8 is sampled but its KV is not computed yet: block 1 is full, not yet hittable.
    first.append_output_token(8)
    assert kv.get_computed_blocks(make_request("c", longer)) == ([0], 4)
    assert kv.allocate_slots(first, 1)
    first.num_computed_tokens += 1
    kv.cache_blocks(first, first.num_computed_tokens)
    assert kv.get_computed_blocks(make_request("d", longer)) == ([0, 1], 8)


def test_duplicate_content_keeps_the_first_copy_cached():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first, second = make_request("a", list(range(5))), make_request("b", list(range(5)))
    # Both miss (admitted in the same step), so both compute block 0.
    for request in (first, second):
        assert kv.allocate_slots(request, 5)
    for request in (first, second):
        request.num_computed_tokens = 5
        kv.cache_blocks(request, 5)
    assert (first.block_ids, second.block_ids) == ([0, 1], [2, 3])
    assert kv.num_cached_blocks == 1
    kv.free(first)
    kv.free(second)
    assert kv.get_computed_blocks(make_request("c", list(range(5)))) == ([0], 4)
    assert kv.free_block_ids() == [2, 3, 1, 4, 5, 6, 7, 0]


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    first = make_request("a", list(range(9)))
    compute_prompt(kv, first)
    assert kv.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    kv.free(first)
    assert kv.free_block_ids() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)


def test_reset_prefix_cache_forgets_only_unreferenced_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first, second = make_request("a", list(range(9))), make_request("b", list(range(100, 109)))
    compute_prompt(kv, first)
    compute_prompt(kv, second)
    kv.free(first)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("a2", list(range(9)))) == ([], 0)
    assert kv.get_computed_blocks(make_request("b2", list(range(100, 109)))) == ([3, 4], 8)


def test_rejects_an_empty_pool():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0, block_size=BLOCK_SIZE)
