"""The worker pulls only what its engine can take now."""

from __future__ import annotations

from dataclasses import dataclass

from apps.bus import wire
from apps.settings import WorkerSettings
from apps.worker.model_loop import ModelLoop
from engine.frontend.protocol import CoreInfo, CoreStats, SamplingParams, ServiceClass


@dataclass
class FakeEngine:
    """Only the capacity surface the pull loop reads."""

    max_num_seqs: int = 4
    max_model_len: int = 2048
    stats: CoreStats = CoreStats()
    slots: int = 4
    info: CoreInfo = CoreInfo(model_id="m", max_model_len=2048, max_num_seqs=4, num_blocks=10, block_size=16)

    def free_slots(self, service_class: ServiceClass = ServiceClass.INTERACTIVE) -> int:
        return self.slots


def request(request_id: str, n: int = 1,
            service_class: ServiceClass = ServiceClass.INTERACTIVE) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id=request_id, model="m", reply_subject="_INBOX.x",
                                sampling=SamplingParams(n=n), service_class=service_class)


def worker(engine: FakeEngine) -> ModelLoop:
    return ModelLoop(WorkerSettings(nats_url="nats://unused"), engine, tokenizer=None, model_id="m")  # type: ignore[arg-type]


def test_each_choice_takes_a_slot() -> None:
    w = worker(FakeEngine(stats=CoreStats(num_blocks=10, num_free_blocks=10)))
    assert w.free_slots() == 4
    w.requests["a"] = request("a", n=3)
    assert w.free_slots() == 1


def test_seats_batch_work_holds_are_free_for_interactive_work() -> None:
    """Interactive requests are pulled into the seats batch lines hold (the scheduler preempts
    those for them, rather than the interactive request waiting in the stream); batch lines count
    every seat."""
    w = worker(FakeEngine(stats=CoreStats(num_blocks=10, num_free_blocks=10)))
    for i in range(4):
        w.requests[f"b{i}"] = request(f"b{i}", service_class=ServiceClass.BATCH)
    assert w.free_slots(ServiceClass.INTERACTIVE) == 4
    assert w.free_slots(ServiceClass.BATCH) == 0
    w.requests["i"] = request("i", n=3)
    assert w.free_slots(ServiceClass.INTERACTIVE) == 1


def test_nothing_is_pulled_while_the_engine_has_work_waiting() -> None:
    assert worker(FakeEngine(stats=CoreStats(num_blocks=10, num_free_blocks=0, num_waiting=1))).free_slots() == 0


def test_batch_work_waiting_in_the_engine_holds_back_only_batch_work() -> None:
    w = worker(FakeEngine(stats=CoreStats(num_blocks=10, num_free_blocks=0, num_waiting=2, num_batch_waiting=2)))
    assert w.free_slots(ServiceClass.INTERACTIVE) == 4  # the scheduler takes it before the batch work
    assert w.free_slots(ServiceClass.BATCH) == 0
    mixed = worker(FakeEngine(stats=CoreStats(num_blocks=10, num_free_blocks=0, num_waiting=2, num_batch_waiting=1)))
    assert mixed.free_slots(ServiceClass.INTERACTIVE) == 0


def test_a_dead_engine_takes_nothing() -> None:
    assert worker(FakeEngine(slots=0)).free_slots() == 0
