"""Priority classes in the scheduler: interactive before batch, `priority` within a class, a
waiting interactive request preempting running batch sequences, aging. The mechanism on a fake
runner, then on a tiny random-weight Llama through the engine core: preempted batch sequences end
with exactly the tokens of an unpreempted greedy run."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import transformers

from engine.core.engine_core import EngineCore
from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import INTERACTIVE_WAITING, KV_CACHE_FULL, Scheduler, SchedulerConfig, SchedulerOutput
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import EngineRequest, SamplingParams, ServiceClass
from engine.loading.loader import Checkpoint, load_checkpoint
from tests.engine.helpers import save_tokenizer
from tests.engine.test_scheduler import BLOCK_SIZE, make_request, make_scheduler, step

BATCH = ServiceClass.BATCH


def batch_request(request_id: str, num_prompt_tokens: int, **kw: object) -> Request:
    request = make_request(request_id, num_prompt_tokens, **kw)  # type: ignore[arg-type]
    request.service_class = BATCH
    return request


def configured(clock: Callable[[], float] = time.monotonic, **config: float) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE),  # type: ignore[arg-type]
                     clock=clock)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chunks(output: SchedulerOutput) -> list[tuple[str, int]]:
    """Each scheduled request's id and the tokens it computes this step."""
    return [(item.request.request_id, item.num_new_tokens) for item in output.scheduled]


def ids(requests: object) -> list[str]:
    return [r.request_id for r in requests]  # type: ignore[attr-defined]


def test_waiting_order_is_class_then_priority_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("blocker", 4, max_tokens=2))
    step(scheduler)
    for request_id, priority, batch in [("b0", 0, True), ("i5", 5, False), ("b-3", -3, True),
                                        ("i0", 0, False), ("i5-later", 5, False)]:
        request = batch_request(request_id, 4) if batch else make_request(request_id, 4)
        request.priority = priority
        scheduler.add_request(request)
    admitted = []
    while scheduler.has_unfinished():
        output, _, _ = step(scheduler)
        admitted += [i.request.request_id for i in output.scheduled if i.num_new_tokens > 1]
    assert admitted == ["i0", "i5", "i5-later", "b-3", "b0"]
    assert scheduler.num_preemptions == 0


def test_interactive_preempts_batch_at_the_sequence_limit():
    scheduler = make_scheduler(max_num_seqs=3)
    for i in range(3):
        scheduler.add_request(batch_request(f"b{i}", 4, max_tokens=40))
    for _ in range(3):
        step(scheduler)
    assert scheduler.num_batch_running == 3
    scheduler.add_request(make_request("i", 4))
    output, _, _ = step(scheduler)
    # The interactive request is computed in the very next step; the newest batch one gave way.
    assert ("i", 4, True) in [(i.request.request_id, i.num_new_tokens, i.sample) for i in output.scheduled]
    assert output.preempted == ["b2"]
    assert [(p.reason, p.tokens_kept) for p in output.preemptions] == [(INTERACTIVE_WAITING, 3)]
    assert ids(scheduler.waiting) == ["b2"]
    assert scheduler.preemptions_by_reason == {KV_CACHE_FULL: 0, INTERACTIVE_WAITING: 1}


def test_interactive_preempts_batch_for_kv_room_newest_first():
    # 8 blocks of 4 tokens: two batch requests of 12 prompt tokens hold 8 blocks once decoding.
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=8)
    scheduler.add_request(batch_request("b0", 12, max_tokens=30))
    scheduler.add_request(batch_request("b1", 12, first_token=2000, max_tokens=30))
    step(scheduler)
    step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 0
    scheduler.add_request(make_request("i", 8, first_token=3000))
    output, _, _ = step(scheduler)
    assert output.preempted == ["b1"]
    assert [p.reason for p in output.preemptions] == [INTERACTIVE_WAITING]
    assert "i" in [i.request.request_id for i in output.scheduled]


def test_interactive_never_preempts_interactive_and_batch_never_preempts():
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.add_request(make_request("i0", 4, max_tokens=5))
    scheduler.add_request(make_request("i1", 4, max_tokens=5))
    step(scheduler)
    scheduler.add_request(make_request("i2", 4))
    scheduler.add_request(batch_request("b", 4))
    output, _, _ = step(scheduler)
    assert output.preempted == []
    assert ids(scheduler.waiting) == ["i2", "b"]


def test_preempted_batch_goes_first_among_batch_work():
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.add_request(batch_request("b0", 4, max_tokens=40))
    scheduler.add_request(batch_request("b1", 4, max_tokens=40))
    step(scheduler)
    scheduler.add_request(batch_request("b2", 4))
    scheduler.add_request(make_request("i", 4, max_tokens=3))
    output, _, _ = step(scheduler)
    assert output.preempted == ["b1"]
    assert ids(scheduler.waiting) == ["b1", "b2"]
    while "i" in scheduler.requests:
        step(scheduler)
    output, _, _ = step(scheduler)
    assert [i.request.request_id for i in output.scheduled] == ["b0", "b1"]
    assert ids(scheduler.waiting) == ["b2"]


def test_a_batch_request_ages_into_interactive_admission():
    scheduler = configured(max_num_seqs=1, batch_aging_steps=3)
    scheduler.add_request(make_request("i0", 4, max_tokens=10))
    step(scheduler)
    scheduler.add_request(batch_request("b", 4, max_tokens=10))
    for _ in range(3):
        step(scheduler)
    # b has waited 3 steps: it now ranks with interactive work and goes ahead of a newer one.
    scheduler.add_request(make_request("i1", 4))
    while "i0" in scheduler.requests:
        step(scheduler)
    output, _, _ = step(scheduler)
    assert [i.request.request_id for i in output.scheduled] == ["b"]
    # Once aged it is interactive work: the waiting interactive request does not preempt it.
    output, _, _ = step(scheduler)
    assert output.preempted == []
    assert ids(scheduler.waiting) == ["i1"]


def test_batch_aging_steps_is_validated():
    with pytest.raises(ValueError, match="batch_aging_steps"):
        SchedulerConfig(batch_aging_steps=0)
    with pytest.raises(ValueError, match="batch_step_interval"):
        SchedulerConfig(batch_step_interval=0)
    with pytest.raises(ValueError, match="batch_prefill_tokens"):
        SchedulerConfig(batch_prefill_tokens=0)
    with pytest.raises(ValueError, match="batch_narrow_tokens"):
        SchedulerConfig(batch_narrow_tokens=0)
    with pytest.raises(ValueError, match="batch_narrow_s"):
        SchedulerConfig(batch_narrow_s=-1)


def test_batch_prompts_take_at_most_their_share_of_a_step_interactive_ones_the_rest():
    scheduler = configured(max_num_seqs=8, batch_prefill_tokens=10)
    scheduler.add_request(batch_request("b0", 8, max_tokens=4))
    scheduler.add_request(batch_request("b1", 8, first_token=2000, max_tokens=4))
    output, _, _ = step(scheduler)
    assert chunks(output) == [("b0", 8), ("b1", 2)]
    output, _, _ = step(scheduler)
    # b0 decodes (a decode is no prompt token); b1's prompt goes on within the share.
    assert chunks(output) == [("b0", 1), ("b1", 6)]
    scheduler.add_request(make_request("i", 30, first_token=3000))
    output, _, _ = step(scheduler)
    assert ("i", 30) in chunks(output)


def test_running_batch_sequences_get_one_step_in_an_interval_while_interactive_work_runs():
    scheduler = configured(max_num_seqs=4, batch_step_interval=3)
    scheduler.add_request(batch_request("b0", 4, max_tokens=40))
    scheduler.add_request(batch_request("b1", 4, max_tokens=40))
    step(scheduler)
    scheduler.add_request(make_request("i", 4, max_tokens=8))
    turns = []
    while "i" in scheduler.requests:
        output, _, _ = step(scheduler)
        scheduled = [item.request.request_id for item in output.scheduled]
        assert "i" in scheduled  # interactive work is in every step
        turns.append([r for r in scheduled if r != "i"])
    # The step that admits "i" carries it alone; then the batch's turn comes every third step.
    assert turns == [[], [], ["b0", "b1"], [], [], ["b0", "b1"], [], []]
    assert scheduler.num_preemptions == 0
    # Without interactive work every step is the batch's.
    for _ in range(3):
        output, _, _ = step(scheduler)
        assert [item.request.request_id for item in output.scheduled] == ["b0", "b1"]


def test_waiting_batch_requests_are_admitted_only_in_the_batchs_turns():
    scheduler = configured(max_num_seqs=4, batch_step_interval=3)
    scheduler.add_request(make_request("i", 4, max_tokens=8))
    step(scheduler)
    scheduler.add_request(batch_request("b", 4, max_tokens=8))
    admitted_at = None
    for index in range(4):
        output, _, _ = step(scheduler)
        if "b" in [item.request.request_id for item in output.scheduled]:
            admitted_at = index
            break
    # A seat was free from the start; the batch request still waited for its turn (the third step
    # with interactive work, the first of them being the one that admitted "i").
    assert admitted_at == 1


def test_batch_steps_are_narrow_while_interactive_work_is_recent_the_batch_taking_turns():
    clock = FakeClock()
    scheduler = configured(clock, max_num_seqs=8, batch_narrow_s=5.0, batch_narrow_tokens=2)
    for i in range(5):
        scheduler.add_request(batch_request(f"b{i}", 4, first_token=100 * (i + 1), max_tokens=200))
    output, _, _ = step(scheduler)
    # No interactive work seen yet: the batch's full width.
    assert len(output.scheduled) == 5
    scheduler.add_request(make_request("i", 4, max_tokens=1))
    step(scheduler)  # "i" runs alone (not the batch's turn) and finishes
    assert "i" not in scheduler.requests
    computed: dict[str, int] = {}
    for _ in range(5):
        output, _, _ = step(scheduler)
        assert sum(item.num_new_tokens for item in output.scheduled) <= 2
        for item in output.scheduled:
            computed[item.request.request_id] = computed.get(item.request.request_id, 0) + 1
    # Two tokens a step, every running batch request in its turn: each of the five twice in five steps.
    assert computed == {f"b{i}": 2 for i in range(5)}
    clock.now += 5.0  # interactive work is no longer recent: the full width again
    output, _, _ = step(scheduler)
    assert len(output.scheduled) == 5


def test_a_batch_prompt_in_a_narrow_step_takes_what_the_running_batch_leaves():
    clock = FakeClock()
    scheduler = configured(clock, max_num_seqs=8, batch_narrow_tokens=6, batch_prefill_tokens=64)
    scheduler.add_request(make_request("i", 4, max_tokens=1))
    step(scheduler)
    scheduler.add_request(batch_request("b0", 4, max_tokens=50))
    scheduler.add_request(batch_request("b1", 20, first_token=2000, max_tokens=50))
    output, _, _ = step(scheduler)
    assert chunks(output) == [("b0", 4), ("b1", 2)]
    output, _, _ = step(scheduler)
    assert chunks(output) == [("b0", 1), ("b1", 5)]


# --- the engine core on a tiny random-weight Llama ------------------------------------------

VOCAB_SIZE = 256


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    directory = tmp_path_factory.mktemp("hf") / "tiny-llama-priority"
    directory.mkdir()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).float().save_pretrained(directory)
    save_tokenizer(directory, VOCAB_SIZE)
    return load_checkpoint(directory)


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def prompt(seed: int) -> list[int]:
    return [3 + (seed * 7 + i * 13) % (VOCAB_SIZE - 3) for i in range(10 + seed)]


def run_to_end(core: EngineCore, tokens: dict[str, list[int]], first_step: list[str] | None = None,
               preempted: list[tuple[str, str | None, int]] | None = None) -> None:
    while core.has_work():
        outputs = core.step()
        if first_step is not None and not first_step:
            first_step.extend(out.request_id for out in outputs if out.new_token_ids)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if preempted is not None and out.preempted:
                preempted.append((out.request_id, out.preempted, out.tokens_kept))


def test_preempted_batch_sequences_finish_as_if_never_preempted(tiny_llama: Checkpoint) -> None:
    alone: dict[str, list[int]] = {}
    reference = EngineCore(tiny_llama, EngineConfig(model="in-memory", enable_prefix_caching=False))
    for i in range(3):
        reference.add_request(EngineRequest(f"b{i}", prompt(i), greedy()))
    run_to_end(reference, alone)

    core = EngineCore(tiny_llama, EngineConfig(model="in-memory", max_num_seqs=3,
                                               enable_prefix_caching=False))
    tokens: dict[str, list[int]] = {}
    for i in range(3):
        core.add_request(EngineRequest(f"b{i}", prompt(i), greedy(), service_class=BATCH))
    for _ in range(4):
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert core.stats.num_batch_running == 3
    core.add_request(EngineRequest("i", prompt(5), greedy()))
    first_step: list[str] = []
    preempted: list[tuple[str, str | None, int]] = []
    run_to_end(core, tokens, first_step, preempted)
    assert "i" in first_step  # its first token came out of the very next step
    # The newest batch sequence gave way, keeping the 4 tokens it had; the output says so.
    assert preempted[0] == ("b2", INTERACTIVE_WAITING, 4)
    assert {request_id for request_id, _, _ in preempted} <= {"b0", "b1", "b2"}
    assert core.stats.preemptions_by_reason[INTERACTIVE_WAITING] == len(preempted)
    assert {k: v for k, v in tokens.items() if k != "i"} == alone
    assert len(tokens["i"]) == 16
