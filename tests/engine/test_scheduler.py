"""Scheduler on CPU with a fake runner that "samples" fixed tokens: budgets, chunks, preemption, stops."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.frontend.protocol import FinishReason, SamplingParams

BLOCK_SIZE = 4


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 8192,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    return Scheduler(config, KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE))


def make_request(
    request_id: str, num_prompt_tokens: int, first_token: int = 1000, max_tokens: int = 16, **sampling
) -> Request:
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **sampling), eos_token_ids=[2])


def step(
    scheduler: Scheduler, sample: Callable[[Request], int] = lambda request: 7
) -> tuple[SchedulerOutput, list[Request], list[Request]]:
    """One engine step with a fake runner: check the chunk is well formed, then "sample"."""
    output = scheduler.schedule()
    sampled = {}
    for item in output.scheduled:
        request = item.request
        start = request.num_computed_tokens
        assert len(request.all_token_ids[start : start + item.num_new_tokens]) == item.num_new_tokens
        assert len(request.block_ids) * BLOCK_SIZE >= start + item.num_new_tokens
        if item.sample:
            sampled[request.request_id] = sample(request)
    assert output.num_batched_tokens == sum(item.num_new_tokens for item in output.scheduled)
    with_new_token, finished = scheduler.update_from_output(output, sampled)
    return output, with_new_token, finished


def chunks(output: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(item.request.request_id, item.num_new_tokens, item.sample) for item in output.scheduled]


def test_importing_the_scheduler_does_not_import_torch():
    code = "import sys, engine.core.scheduler, engine.core.kv_cache; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    "kwargs",
    [{"max_num_seqs": 0}, {"max_num_batched_tokens": 0}, {"max_model_len": 0}],
    ids=["max_num_seqs", "max_num_batched_tokens", "max_model_len"],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


def test_chunked_prefill_under_the_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 20))
    scheduler.add_request(make_request("b", 5, first_token=2000))

    output, with_new_token, _ = step(scheduler)
    assert chunks(output) == [("a", 8, False)]
    assert with_new_token == []
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)

    output, _, _ = step(scheduler)
    assert chunks(output) == [("a", 8, False)]
    # The rest of a's prompt first, then b gets what is left of the budget.
    output, with_new_token, _ = step(scheduler)
    assert chunks(output) == [("a", 4, True), ("b", 4, False)]
    assert [r.request_id for r in with_new_token] == ["a"]

    output, with_new_token, _ = step(scheduler)
    assert chunks(output) == [("a", 1, True), ("b", 1, True)]
    assert [r.request_id for r in with_new_token] == ["a", "b"]
    output, _, _ = step(scheduler)
    assert chunks(output) == [("a", 1, True), ("b", 1, True)]
    assert output.num_batched_tokens == 2
    a, b = scheduler.requests["a"], scheduler.requests["b"]
    assert (a.num_computed_tokens, a.num_output_tokens) == (22, 3)
    assert (b.num_computed_tokens, b.num_output_tokens) == (6, 2)
    # Each step allocates in scheduling order: a's sixth block (step 4) came before b's second.
    assert a.block_ids == [0, 1, 2, 3, 4, 6] and b.block_ids == [5, 7]


def test_decodes_go_before_prefills():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    scheduler.add_request(make_request("a", 3))
    step(scheduler)
    scheduler.add_request(make_request("b", 10, first_token=2000))
    output, _, _ = step(scheduler)
    assert chunks(output) == [("a", 1, True), ("b", 5, False)]


def test_max_num_seqs_is_respected():
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, 3, max_tokens=2))
    output, _, _ = step(scheduler)
    assert chunks(output) == [("a", 3, True), ("b", 3, True)]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    output, _, finished = step(scheduler)
    assert chunks(output) == [("a", 1, True), ("b", 1, True)]
    assert [r.request_id for r in finished] == ["a", "b"]
    output, _, _ = step(scheduler)
    assert chunks(output) == [("c", 3, True)]
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 0)


def test_waiting_requests_are_admitted_in_order_without_skipping():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 10, max_tokens=2))  # 3 blocks
    scheduler.add_request(make_request("b", 8, first_token=2000))  # 2 blocks: does not fit yet
    scheduler.add_request(make_request("c", 2, first_token=3000))  # would fit, but must not overtake b
    output, _, _ = step(scheduler)
    assert chunks(output) == [("a", 10, True)]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    output, _, finished = step(scheduler)
    assert [r.request_id for r in finished] == ["a"]
    output, _, _ = step(scheduler)
    assert chunks(output) == [("b", 8, True), ("c", 2, True)]


def test_prefix_hits_are_skipped_and_reported():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10, max_tokens=1))
    output, _, finished = step(scheduler)
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].num_cached_tokens == 0

    scheduler.add_request(make_request("b", 10))
    output, _, _ = step(scheduler)
    assert chunks(output) == [("b", 2, True)]
    b = output.scheduled[0].request
    assert b.num_cached_tokens == 8
    # a's two full blocks are hit; its partial block 2 went back to the head of the free queue.
    assert b.block_ids == [0, 1, 2]
    assert (scheduler.kv_cache.prefix_queries, scheduler.kv_cache.prefix_hits) == (20, 8)


def test_the_newest_running_request_is_preempted_and_recomputed():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=2)
    a = make_request("a", 8, max_tokens=3)
    b = make_request("b", 7, first_token=2000)
    c = make_request("c", 2, first_token=3000)
    for request in (a, b, c):
        scheduler.add_request(request)

    output, _, _ = step(scheduler)
    assert chunks(output) == [("a", 8, True), ("b", 7, True)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])

    # a (older) needs a third block and none is free: b, the newest, makes room.
    output, _, _ = step(scheduler)
    assert output.preempted == ["b"]
    assert chunks(output) == [("a", 1, True)]
    assert a.block_ids == [0, 1, 3]
    assert (b.status, b.num_computed_tokens, b.block_ids) == (RequestStatus.WAITING, 0, [])
    assert b.all_token_ids == list(range(2000, 2007)) + [7]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.num_preemptions == 1

    # b would hit its old block 2, but it and a new block do not fit beside a yet.
    output, _, finished = step(scheduler)
    assert chunks(output) == [("a", 1, True)]
    assert [r.request_id for r in finished] == ["a"]
    assert scheduler.kv_cache.num_free_blocks == 4

    # Recomputed over prompt + output so far; block 2 (b's first 4 tokens) is a prefix hit.
    output, _, _ = step(scheduler)
    assert chunks(output) == [("b", 4, True), ("c", 2, True)]
    assert b.block_ids == [2, 3]
    assert b.num_cached_tokens == 0  # set when it was first scheduled, not on recompute
    assert b.output_token_ids == [7, 7]
    assert c.block_ids == [1]
    assert scheduler.kv_cache.prefix_hits == 4


def test_a_request_that_needs_the_last_block_preempts_itself_when_newest():
    scheduler = make_scheduler(num_blocks=5)
    a = make_request("a", 7, max_tokens=4)
    b = make_request("b", 7, first_token=2000)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    step(scheduler)
    # Both now need a third block; a takes the only free one, b has nobody newer to preempt.
    output, _, _ = step(scheduler)
    assert output.preempted == ["b"]
    assert chunks(output) == [("a", 1, True)]
    assert a.block_ids == [0, 1, 4]
    assert list(scheduler.waiting) == [b]


def test_a_sequence_never_outgrows_the_pool():
    scheduler = make_scheduler(num_blocks=2)
    request = make_request("a", 5, max_tokens=100)
    scheduler.add_request(request)
    finished: list[Request] = []
    while not finished:
        _, _, finished = step(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 8
    assert scheduler.num_preemptions == 0


def test_abort_frees_blocks_at_once():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6, first_token=2000))
    step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 6
    aborted = scheduler.abort_requests(["a", "b", "unknown"])
    assert [r.request_id for r in aborted] == ["a", "b"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert aborted[0].status.finish_reason == FinishReason.ABORT
    assert aborted[0].block_ids == []
    assert scheduler.kv_cache.num_free_blocks == 8
    assert not scheduler.has_unfinished()
    assert scheduler.abort_requests(["a"]) == []


def test_a_request_aborted_mid_step_is_not_advanced():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6))
    output = scheduler.schedule()
    (request,) = scheduler.abort_requests(["a"])
    with_new_token, finished = scheduler.update_from_output(output, {"a": 7})
    assert (with_new_token, finished) == ([], [])
    assert request.num_computed_tokens == 0 and request.output_token_ids == []
    assert scheduler.kv_cache.num_free_blocks == 64


@pytest.mark.parametrize(
    "num_prompt_tokens, error",
    [(9, "max_model_len"), (17, "KV cache")],
    ids=["longer-than-max-model-len", "more-blocks-than-the-pool"],
)
def test_a_request_that_can_never_run_is_rejected_at_add(num_prompt_tokens, error):
    scheduler = make_scheduler(num_blocks=4, max_model_len=8 if error == "max_model_len" else 64)
    request = make_request("a", num_prompt_tokens)
    scheduler.add_request(request)
    assert request.status == RequestStatus.FINISHED_ERROR
    assert error in request.error
    assert scheduler.has_unfinished() and scheduler.num_waiting == 0
    output, with_new_token, finished = step(scheduler)
    assert output.scheduled == [] and with_new_token == []
    assert finished == [request]
    assert not scheduler.has_unfinished()


def test_a_duplicate_request_id_is_rejected_without_touching_the_live_request():
    scheduler = make_scheduler()
    live = make_request("a", 3)
    scheduler.add_request(live)
    step(scheduler)
    blocks, computed = list(live.block_ids), live.num_computed_tokens
    duplicate = make_request("a", 5)
    scheduler.add_request(duplicate)
    assert duplicate.status == RequestStatus.FINISHED_ERROR and "duplicate" in duplicate.error
    assert scheduler.requests["a"] is live
    output, with_new_token, finished = step(scheduler)
    assert finished == [duplicate] and with_new_token == [live]
    assert [item.request for item in output.scheduled] == [live]
    assert live.status == RequestStatus.RUNNING and live.block_ids == blocks
    assert live.num_computed_tokens == computed + 1


@pytest.mark.parametrize("prompt, sampling, error", [
    ([], {}, "at least one prompt token"),
    ([5, 6], {"max_tokens": None}, "max_tokens"),
    ([5, 100, 6], {}, "outside the vocabulary"),
    ([5, -1], {}, "outside the vocabulary"),
], ids=["empty-prompt", "unresolved-max-tokens", "token-past-the-vocab", "negative-token"])
def test_a_request_the_model_cannot_take_is_rejected_alone(prompt, sampling, error):
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, vocab_size=100)
    scheduler = Scheduler(config, KVCacheManager(16, 4))
    good = Request("good", [1, 2, 3], SamplingParams(max_tokens=4))
    bad = Request("bad", prompt, SamplingParams(**{"max_tokens": 4, **sampling}))
    scheduler.add_request(good)
    scheduler.add_request(bad)
    assert bad.status == RequestStatus.FINISHED_ERROR and error in bad.error
    output, with_new_token, finished = step(scheduler)
    assert finished == [bad] and with_new_token == [good]
    assert [item.request for item in output.scheduled] == [good]


def test_prompt_that_fills_max_model_len_is_rejected():
    scheduler = make_scheduler(max_model_len=8)
    request = make_request("a", 8)
    scheduler.add_request(request)
    assert request.status == RequestStatus.FINISHED_ERROR and "no room" in request.error


@pytest.mark.parametrize(
    "sampling, tokens, status, num_outputs, stop_token",
    [
        ({}, [5, 2, 5], RequestStatus.FINISHED_STOPPED, 2, 2),
        ({"ignore_eos": True, "max_tokens": 3}, [5, 2, 2, 5], RequestStatus.FINISHED_LENGTH, 3, None),
        ({"stop_token_ids": [9]}, [5, 9, 5], RequestStatus.FINISHED_STOPPED, 2, 9),
        ({"stop_token_ids": [9], "ignore_eos": True}, [2, 9, 5], RequestStatus.FINISHED_STOPPED, 2, 9),
        ({"min_tokens": 3}, [2, 2, 2, 2], RequestStatus.FINISHED_STOPPED, 3, 2),
        ({"min_tokens": 2, "stop_token_ids": [9]}, [9, 5, 9], RequestStatus.FINISHED_STOPPED, 3, 9),
        ({"max_tokens": 4}, [5, 5, 5, 5, 5], RequestStatus.FINISHED_LENGTH, 4, None),
        ({"max_tokens": 1}, [2], RequestStatus.FINISHED_STOPPED, 1, 2),
    ],
    ids=[
        "eos", "ignore-eos", "stop-token-id", "stop-token-despite-ignore-eos", "min-tokens-delays-eos",
        "min-tokens-delays-stop-token", "max-tokens", "eos-wins-over-length",
    ],
)
def test_stop_conditions(sampling, tokens, status, num_outputs, stop_token):
    scheduler = make_scheduler()
    sampling = {"max_tokens": 16, **sampling}
    request = make_request("a", 3, **sampling)
    scheduler.add_request(request)
    finished: list[Request] = []
    while not finished:
        _, _, finished = step(scheduler, lambda r: tokens[r.num_output_tokens])
    assert finished == [request]
    assert request.status == status
    assert request.output_token_ids == tokens[:num_outputs]
    # A stop ends on the token that stopped it (its last output); a length finish on no stop token.
    assert (request.output_token_ids[-1] if status == RequestStatus.FINISHED_STOPPED else None) == stop_token
    assert request.block_ids == [] and not scheduler.has_unfinished()
    assert scheduler.kv_cache.num_free_blocks == 64


def test_max_model_len_ends_with_length():
    scheduler = make_scheduler(max_model_len=8)
    request = make_request("a", 5)
    scheduler.add_request(request)
    finished: list[Request] = []
    while not finished:
        _, _, finished = step(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert (request.num_tokens, request.num_output_tokens) == (8, 3)


def test_state_slots_cap_running_and_are_released_on_finish_preempt_and_abort():
    """Hybrid models: a running request holds one state slot, from admission to finish, abort or
    preemption; with no free slot, nothing more is admitted, whatever max_num_seqs says."""
    from engine.core.state_slots import StateSlotPool

    slots = StateSlotPool(2)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8),
                          KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE, enable_prefix_caching=False),
                          slots)
    a = make_request("a", 8, max_tokens=2)
    b = make_request("b", 7, first_token=2000)
    c = make_request("c", 2, first_token=3000)
    for request in (a, b, c):
        scheduler.add_request(request)

    output, _, _ = step(scheduler)
    assert chunks(output) == [("a", 8, True), ("b", 7, True)]  # c waits for a slot, not for blocks
    assert (a.state_slot, b.state_slot, c.state_slot, slots.num_free) == (0, 1, None, 0)

    output, _, finished = step(scheduler)  # a finishes: its slot goes back...
    assert [r.request_id for r in finished] == ["a"] and a.state_slot is None
    output, _, _ = step(scheduler)  # ...and c takes it
    assert ("c", 2, True) in chunks(output) and c.state_slot == 0

    for _ in range(20):  # b and c grow until the pool is full and c, the newest, is preempted
        output, _, _ = step(scheduler)
        if output.preempted:
            break
    assert output.preempted == ["c"]
    assert (c.status, c.state_slot, slots.num_free) == (RequestStatus.WAITING, None, 1)

    scheduler.abort_requests(["b", "c"])
    assert (b.state_slot, slots.num_free) == (None, 2)
