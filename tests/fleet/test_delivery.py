"""Several workers of one model: shared load, and what a client sees when a worker dies (SPEC §3)."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from apps.bus import topology
from apps.bus.events import Event, RunFinished
from tests.fleet.conftest import Fleet, finished_subjects, wait_events
from tests.support import eventually

REPLY = "one two three four five six seven eight nine ten eleven twelve"


def client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=90)


def ask(fleet: Fleet, model: str, content: str) -> str:
    reply = client(fleet).chat.completions.create(model=model, messages=[{"role": "user", "content": content}])
    return reply.choices[0].message.content or ""


def finished(events: list[Event], request_ids: set[str] | None = None) -> list[RunFinished]:
    return [e for e in events if isinstance(e, RunFinished)
            and (request_ids is None or e.request_id in request_ids)]


def test_two_workers_share_one_consumer(fleet: Fleet) -> None:
    model = "shared-model"
    script = {"default": REPLY, "rules": [{"match": "share", "reply": REPLY, "token_delay_s": 0.02}]}
    with fleet.workers_of([("share-a", model, script), ("share-b", model, script)],
                          HELEXA_MAX_NUM_SEQS="3"):
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda i: ask(fleet, model, f"share {i}"), range(12)))
        assert answers == [REPLY] * 12
        events = wait_events(fleet.nats_url, finished_subjects(model),
                             lambda es: len(finished(es)) >= 12)
    served_by = {e.node for e in finished(events)}
    assert served_by == {"share-a", "share-b"}
    assert all(e.status == "ok" and e.attempt == 1 for e in finished(events))


def test_unstarted_requests_move_to_another_worker(fleet: Fleet) -> None:
    model = "handover-model"
    holding = {"default": REPLY, "rules": [{"match": "hold", "reply": REPLY, "first_token_delay_s": 300}]}
    with fleet.worker("handover-a", model, holding, HELEXA_MAX_NUM_SEQS="4") as doomed:
        with ThreadPoolExecutor(3) as pool:
            answers = pool.map(lambda i: ask(fleet, model, f"hold {i}"), range(3))
            started = wait_events(fleet.nats_url, topology.event_subject("run.started", model),
                                  lambda es: len(es) >= 3)
            assert {e.node for e in started} == {"handover-a"}
            doomed.kill()
            # The requests are held by no one now; a new worker gets them from JetStream.
            with fleet.worker("handover-b", model, {"default": REPLY}):
                assert list(answers) == [REPLY] * 3
                ids = {e.request_id for e in started}
                events = wait_events(fleet.nats_url, finished_subjects(model),
                                     lambda es: len(finished(es, ids)) >= 3)
    outcomes = finished(events, ids)
    assert {(e.node, e.status, e.attempt) for e in outcomes} == {("handover-b", "ok", 2)}


def test_a_request_that_kills_its_workers_is_tried_a_bounded_number_of_times(fleet: Fleet) -> None:
    model = "poison-model"
    script = {"default": "still serving", "rules": [{"match": "POISON", "reply": "", "fault": "exit"}]}
    specs = [(f"poison-{n}", model, script) for n in "abc"]
    with fleet.workers_of(specs) as workers:
        with pytest.raises(openai.InternalServerError) as failure:
            ask(fleet, model, "POISON pill")
        assert failure.value.status_code == 500
        assert "tried 2 times" in failure.value.message
        dead = [w for w in workers if w.process.poll() is not None]
        assert 1 <= len(dead) <= 2  # max_deliver = 2: never all three
        assert all(w.process.returncode == 70 for w in dead)
        assert ask(fleet, model, "are you alive") == "still serving"
        events = wait_events(fleet.nats_url, finished_subjects(model),
                             lambda es: any(e.error == "delivery_failed" for e in finished(es)))
    lost = [e for e in finished(events) if e.error == "delivery_failed"]
    assert len(lost) == 1 and lost[0].attempt == 2 and lost[0].status == "error"


def test_a_silent_worker_leaves_the_registry_and_comes_back(fleet: Fleet) -> None:
    model = "ttl-model"

    def listed() -> set[str]:
        return {m["id"] for m in httpx.get(f"{fleet.base_url}/v1/models", timeout=10).json()["data"]}

    # The registry's expiry has no event a client can wait on: the test polls what HTTP shows.
    with fleet.worker("ttl-a", model, {"default": "hi"}) as worker:
        assert model in listed()
        worker.process.send_signal(signal.SIGSTOP)  # alive but silent: no refresh
        try:
            eventually(lambda: model not in listed(), 30, interval_s=0.2, message="the silent node expired")
        finally:
            worker.process.send_signal(signal.SIGCONT)
        eventually(lambda: model in listed(), 30, interval_s=0.2, message="the node listed again")
        assert ask(fleet, model, "hello") == "hi"
        worker.kill()
        eventually(lambda: model not in listed(), 30, interval_s=0.2, message="the killed node expired")
    # The same node restarted is seen afresh.
    with fleet.worker("ttl-a", model, {"default": "hi again"}):
        assert model in listed()
        assert ask(fleet, model, "hello") == "hi again"

