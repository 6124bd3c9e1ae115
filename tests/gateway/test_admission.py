"""Admission semantics (SPEC §5) with real asyncio tasks: caps, FIFO hand-over, Retry-After, and
reservations released however a wait ends (the permanent-429 regression)."""

from __future__ import annotations

import asyncio
import random

import pytest

from apps.bus import wire
from apps.bus.codes import ServingError
from apps.bus.events import AdmissionDecided
from apps.gateway.admission import Admission, AdmissionLimits, Admissions, Rejected
from apps.gateway.metrics import GatewayMetrics
from engine.frontend.protocol import SamplingParams
from tests.support import eventually_async


async def test_cancelled_queued_waiters_release_everything() -> None:
    admission = Admission(AdmissionLimits(max_in_flight=1, max_queue_depth=2, max_per_principal=3, max_wait_s=60))
    running = await admission.acquire("p")
    waiters = [asyncio.create_task(admission.acquire("p")) for _ in range(2)]
    await eventually_async(lambda: admission.pending == 3, 5.0, interval_s=0, message="both waiters queued")
    assert (admission.pending, admission.in_flight, admission.by_principal) == (3, 1, {"p": 3})

    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert (admission.pending, admission.in_flight, admission.by_principal) == (1, 1, {"p": 1})

    newcomer = asyncio.create_task(admission.acquire("p"))  # queues: not a 429
    await eventually_async(lambda: admission.pending == 2, 5.0, interval_s=0, message="the newcomer queued")
    assert not newcomer.done() and admission.pending == 2
    running.release()
    ticket = await asyncio.wait_for(newcomer, 5)
    assert admission.in_flight == 1
    ticket.release()
    ticket.release()  # idempotent
    assert (admission.pending, admission.in_flight, admission.by_principal) == (0, 0, {})


async def test_overload_gives_the_expected_mix() -> None:
    admission = Admission(AdmissionLimits(max_in_flight=2, max_queue_depth=2, max_wait_s=60))
    tasks = [asyncio.create_task(admission.acquire(None)) for _ in range(10)]
    def all_decided() -> bool:
        return admission.pending + sum(t.done() and t.exception() is not None for t in tasks) == 10

    await eventually_async(all_decided, 5.0, interval_s=0, message="every request reserved or rejected")
    rejected = [t.exception() for t in tasks if t.done() and t.exception()]
    admitted = [t.result() for t in tasks if t.done() and not t.exception()]
    queued = [t for t in tasks if not t.done()]
    assert (len(admitted), len(queued), len(rejected)) == (2, 2, 6)
    assert all(isinstance(r, Rejected) and r.decision == "queue_full" and r.status == 503 for r in rejected)
    # Retry-After = clamp(((pending − in_flight cap)₊ + 1) × 2, 1, 120) with 4 pending, cap 2.
    assert {r.retry_after for r in rejected} == {6}
    for ticket in admitted:
        ticket.release()
    for ticket in await asyncio.gather(*queued):
        ticket.release()
    assert (admission.pending, admission.in_flight) == (0, 0)


async def test_per_principal_cap_is_429_while_others_are_served() -> None:
    admission = Admission(AdmissionLimits(max_in_flight=4, max_queue_depth=4, max_per_principal=2))
    heavy = [await admission.acquire("heavy") for _ in range(2)]
    with pytest.raises(Rejected) as caught:
        await admission.acquire("heavy")
    assert caught.value.decision == "principal_cap" and caught.value.status == 429
    light = await admission.acquire("light")
    anonymous = [await admission.acquire(None) for _ in range(1)]  # exempt from the per-principal cap
    for ticket in heavy + [light] + anonymous:
        ticket.release()
    assert admission.by_principal == {}


async def test_a_wait_longer_than_max_wait_is_a_503_timeout() -> None:
    admission = Admission(AdmissionLimits(max_in_flight=1, max_queue_depth=1, max_wait_s=0.05))
    holder = await admission.acquire("a")
    with pytest.raises(Rejected) as caught:
        await admission.acquire("b")
    assert caught.value.decision == "timeout" and caught.value.status == 503
    assert (admission.pending, admission.in_flight, admission.by_principal) == (1, 1, {"a": 1})
    holder.release()
    assert (admission.pending, admission.in_flight) == (0, 0)


async def test_waiters_are_served_in_arrival_order() -> None:
    admission = Admission(AdmissionLimits(max_in_flight=1, max_queue_depth=3))
    first = await admission.acquire(None)
    order: list[int] = []

    async def wait(i: int) -> None:
        ticket = await admission.acquire(None)
        order.append(i)
        ticket.release()

    waiters = [asyncio.create_task(wait(i)) for i in range(3)]
    await eventually_async(lambda: admission.pending == 4, 5.0, interval_s=0, message="the three waiters queued")
    first.release()
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2]


async def test_no_limits_means_no_queueing() -> None:
    admission = Admission(AdmissionLimits())
    tickets = [await admission.acquire("p") for _ in range(50)]
    assert admission.in_flight == 50
    for ticket in tickets:
        ticket.release()
    assert admission.pending == 0


def test_per_model_limits_from_toml(tmp_path) -> None:
    from apps.gateway.admission import load_per_model

    path = tmp_path / "admission.toml"
    path.write_text('[models."Qwen/Qwen3-8B"]\nmax_in_flight = 4\nmax_per_principal = 2\n'
                    '[models.small]\nmax_queue_depth = 9\n')
    defaults = AdmissionLimits(max_in_flight=16, max_queue_depth=32, max_wait_s=30)
    limits = load_per_model(path, defaults)
    assert limits["Qwen/Qwen3-8B"] == AdmissionLimits(max_in_flight=4, max_queue_depth=32, max_wait_s=30,
                                                      max_per_principal=2)
    assert limits["small"] == AdmissionLimits(max_in_flight=16, max_queue_depth=9, max_wait_s=30)
    path.write_text("[models.x]\nmax_inflight = 1\n")
    with pytest.raises(ValueError, match="max_inflight"):
        load_per_model(path, defaults)


async def test_a_request_with_n_choices_takes_n_slots() -> None:
    admission = Admission(AdmissionLimits(max_in_flight=4, max_queue_depth=4, max_per_principal=3))
    four = await admission.acquire(None, weight=4)
    assert (admission.pending, admission.in_flight) == (4, 4)
    queued = asyncio.create_task(admission.acquire(None, weight=2))
    await eventually_async(lambda: admission.pending == 6, 5.0, interval_s=0, message="the weight-2 request queued")
    assert not queued.done() and admission.pending == 6
    with pytest.raises(Rejected) as full:
        await admission.acquire(None, weight=3)  # 6 + 3 > 4 in flight + 4 queued
    assert full.value.decision == "queue_full"
    four.release()
    two = await asyncio.wait_for(queued, 5)
    assert (admission.pending, admission.in_flight) == (2, 2)
    # More choices than a limit allows weigh that limit (here the principal's 3): such a request
    # waits for room instead of never fitting.
    big = asyncio.create_task(admission.acquire("p", weight=16))
    await eventually_async(lambda: admission.pending == 5, 5.0, interval_s=0, message="the big request queued")
    assert not big.done() and (admission.pending, admission.by_principal) == (5, {"p": 3})
    two.release()
    ticket = await asyncio.wait_for(big, 5)
    assert (ticket.weight, admission.in_flight) == (3, 3)
    ticket.release()
    assert (admission.pending, admission.in_flight, admission.by_principal) == (0, 0, {})


async def test_admission_is_released_whenever_the_caller_is_cancelled() -> None:
    """Cancel admitted and queued requests at every await of their life (the permanent-429
    regression): the counters return to zero and every decision is emitted without waiting."""
    emitted: list[AdmissionDecided] = []
    admissions = Admissions(AdmissionLimits(max_in_flight=2, max_queue_depth=50, max_per_principal=40), None,
                            GatewayMetrics(), emitted.append)
    rng = random.Random(7)

    async def one(i: int) -> None:
        request = wire.GenerateRequest(request_id=f"r{i}", model="m", reply_subject="", principal="p",
                                       sampling=SamplingParams(n=rng.choice([1, 1, 2])))
        ticket = await admissions.admit(request)
        try:
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)  # the generation's awaits
        finally:
            ticket.release()

    tasks = [asyncio.create_task(one(i)) for i in range(40)]
    for _ in range(60):
        await asyncio.sleep(0)
        running = [t for t in tasks if not t.done()]
        if running and rng.random() < 0.5:
            rng.choice(running).cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    admission = admissions.for_model("m")
    assert (admission.pending, admission.in_flight, admission.by_principal) == (0, 0, {})
    assert {e.decision for e in emitted} <= {"admitted", "cancelled", "queue_full", "principal_cap"}
    assert sum(e.decision == "cancelled" for e in emitted) > 0


async def test_calls_are_admitted_in_pools_of_their_own_kind() -> None:
    """Token counts and stored-response reads take slots of their own kind, under the model's
    limits: they queue and shed like generations, and never wait behind one."""
    emitted: list[AdmissionDecided] = []
    admissions = Admissions(AdmissionLimits(max_in_flight=1, max_queue_depth=1, max_per_principal=1), None,
                            GatewayMetrics(), emitted.append)
    generation = await admissions.admit(wire.GenerateRequest(request_id="g", model="m", reply_subject="",
                                                             sampling=SamplingParams()))
    count = await admissions.admit_call("tokenize", "m", "t1", None)  # the generation holds "m", not this
    queued = asyncio.create_task(admissions.admit_call("tokenize", "m", "t2", None))
    await eventually_async(lambda: admissions.for_call("tokenize", "m").pending == 2, 5.0, interval_s=0,
                           message="the second count queued")
    assert not queued.done()
    with pytest.raises(ServingError) as full:
        await admissions.admit_call("tokenize", "m", "t3", None)
    assert (full.value.status, full.value.code, full.value.retry_after_s) == (503, "queue_full", 4)
    read = await admissions.admit_call("responses.get", "-", "resp_1", "alice")
    with pytest.raises(ServingError) as capped:
        await admissions.admit_call("responses.get", "-", "resp_2", "alice")
    assert capped.value.status == 429
    count.release()
    (await asyncio.wait_for(queued, 5)).release()
    for ticket in (generation, read):
        ticket.release()
    assert all((a.pending, a.in_flight) == (0, 0) for a in (*admissions.by_model.values(),
                                                             *admissions.by_call.values()))
    assert [(e.request_id, e.decision, e.detail) for e in emitted] == [
        ("g", "admitted", None), ("t1", "admitted", "tokenize"), ("t3", "queue_full", "tokenize"),
        ("resp_1", "admitted", "responses.get"), ("resp_2", "principal_cap", "responses.get"),
        ("t2", "admitted", "tokenize")]
