"""The paged KV cache's bookkeeping: block ids, reference counts, the free-block LRU and prefix hashes.

No tensors live here; the model runner owns the KV memory and indexes it with the block ids this
module hands out. A block's KV is reusable by any request whose tokens up to and including that block
are the same, so each FULL, computed block is registered under a hash chained from its parent block's
hash. Freed blocks keep their hash and stay hittable until the free queue hands them out again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

from engine.core.request import Request

BlockHash = bytes
# (parent block's hash or None for the first block, the block's token ids) -> the block's hash.
HashFn = Callable[[BlockHash | None, tuple[int, ...]], BlockHash]


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    """SHA-256 of the parent hash and the tokens: the hash must not be one a crafted prompt can
    collide with (Python's `hash` can be), within a salt's requests or across salts."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVBlock:
    """One block of `block_size` token slots. `block_hash` is set only while it is in the prefix cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Kept with the hash so a hit can be verified, not just trusted.
        self.parent_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


def salt_root(cache_salt: str) -> BlockHash | None:
    """The parent hash of a request's first block: None for the shared cache, else one derived
    from its salt, so blocks hit only between requests with the same salt (the same principal:
    another tenant's prompt can be neither reused nor probed for by its hit count or speed)."""
    if not cache_salt:
        return None
    return hashlib.sha256(b"helexa cache salt\0" + cache_salt.encode()).digest()


class _RequestHashes:
    """Per request: hashes of its full blocks (computed lazily), how many blocks are registered,
    and the parent hash of its first block (`salt_root`)."""

    __slots__ = ("hashes", "num_cached_blocks", "root")

    def __init__(self, root: BlockHash | None) -> None:
        self.hashes: list[BlockHash] = []
        self.num_cached_blocks = 0
        self.root = root


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with ref_cnt 0 in eviction order: allocation pops the head.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._requests: dict[str, _RequestHashes] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free_queue) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free queue from head (next to be allocated) to tail."""
        return list(self._free_queue)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached blocks matching the request's leading tokens, and their token count.

        Never all of the request's tokens: the last one must be computed to get logits to sample from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        # A request still in the table has been looked up since it was last freed (it is retrying
        # admission); count each admission once so the hit rate is not skewed by retries.
        first_lookup = request.request_id not in self._requests
        state = self._state(request)
        token_ids = request.all_token_ids
        max_hit_blocks = (len(token_ids) - 1) // self.block_size
        block_ids: list[int] = []
        parent_hash = state.root
        for i in range(max_hit_blocks):
            block_tokens = self._block_tokens(token_ids, i)
            block_hash = self._block_hash(state, token_ids, i)
            block = self._cached.get(block_hash)
            if block is None or block.token_ids != block_tokens or block.parent_hash != parent_hash:
                break
            block_ids.append(block.block_id)
            parent_hash = block_hash
        num_hit_tokens = len(block_ids) * self.block_size
        if first_lookup:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += num_hit_tokens
        return block_ids, num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Grow `request.block_ids` to hold its computed tokens (plus `computed_blocks`, for a request
        being admitted) and `num_new_tokens` more. All or nothing: on False nothing has changed."""
        computed_blocks = computed_blocks or []
        if computed_blocks and request.block_ids:
            raise ValueError("computed_blocks are only for a request that holds no blocks yet")
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.num_blocks_for(num_tokens) - len(request.block_ids) - len(computed_blocks)
        hit_blocks = [self.blocks[block_id] for block_id in computed_blocks]
        # A hit on a cached block that nobody references takes it out of the free queue.
        num_hits_on_free = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_hits_on_free > len(self._free_queue):
            return False
        for block in hit_blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1
            request.block_ids.append(block.block_id)
        for _ in range(num_new_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            request.block_ids.append(block.block_id)
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that became full and computed; call after each step."""
        if not self.enable_prefix_caching:
            return
        state = self._state(request)
        token_ids = request.all_token_ids
        num_full_blocks = min(num_computed_tokens // self.block_size, len(request.block_ids))
        for i in range(state.num_cached_blocks, num_full_blocks):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is not None:
                continue  # a prefix-cache hit, already registered
            block_hash = self._block_hash(state, token_ids, i)
            # Same content computed twice (two requests missed the same prefix in one step): the
            # first copy stays the cached one; this one is freed unhashed.
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            block.parent_hash = state.hashes[i - 1] if i > 0 else state.root
            block.token_ids = self._block_tokens(token_ids, i)
            self._cached[block_hash] = block
        state.num_cached_blocks = max(state.num_cached_blocks, num_full_blocks)

    def free(self, request: Request) -> None:
        """Drop the request's references, last block first, so a sequence's tail is evicted before
        its prefix. Cached blocks go to the tail of the free queue (most recently used); blocks
        without a hash hold nothing reusable and go to the head, to be reused first."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block_id] = block
                if block.block_hash is None:
                    self._free_queue.move_to_end(block_id, last=False)
        request.block_ids = []
        self._requests.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody references (e.g. after new weights are loaded)."""
        for block in self._free_queue.values():
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.parent_hash = None
            block.token_ids = ()

    def _state(self, request: Request) -> _RequestHashes:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestHashes(salt_root(request.cache_salt))
        return state

    def _block_tokens(self, token_ids: list[int], index: int) -> tuple[int, ...]:
        return tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _block_hash(self, state: _RequestHashes, token_ids: list[int], index: int) -> BlockHash:
        # Tokens are append-only, so a full block's hash never changes once computed.
        hashes = state.hashes
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[i - 1] if i > 0 else state.root
            hashes.append(self.hash_fn(parent, self._block_tokens(token_ids, i)))
        return hashes[index]
