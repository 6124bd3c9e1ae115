"""Interactive time to first token by batch load: the gateway files each interactive answer's TTFT
under whether the model's workers last reported batch sequences running, so /metrics shows what
batch work costs interactive users; batch lines themselves are not counted there."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from apps.bus import wire
from apps.gateway.generation_metrics import GenerationMetrics
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.node_registry import batch_running
from engine.frontend.protocol import SamplingParams, ServiceClass

FAMILY = "helexa:interactive_time_to_first_token_seconds_count"


def request(model: str, service_class: ServiceClass = ServiceClass.INTERACTIVE) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id=f"r-{model}-{service_class}", model=model, reply_subject="r",
                                sampling=SamplingParams(), prompt="hi", service_class=service_class)


def counts(metrics: GatewayMetrics) -> dict[tuple[str, str], float]:
    text = metrics.render([], {}).decode()
    return {(s.labels["model"], s.labels["batch_load"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == FAMILY}


def test_each_interactive_first_token_is_filed_under_its_models_batch_load() -> None:
    metrics = GatewayMetrics()
    generations = GenerationMetrics(metrics, batch_load=lambda model: model == "busy")
    for req in (request("busy"), request("idle"), request("busy", ServiceClass.BATCH)):
        timer = generations.answer(req)
        timer.frame(wire.Delta(seq=0, text="a", num_tokens=1))
        timer.frame(wire.Delta(seq=1, text="b", num_tokens=1))  # not a first token
    assert counts(metrics) == {("busy", "yes"): 1.0, ("idle", "no"): 1.0}


def test_batch_load_is_what_the_nodes_last_reported_for_the_model() -> None:
    def node(name: str, **running: int) -> wire.NodeStatus:
        return wire.NodeStatus(node=name, version="v", models=[
            wire.ModelStatus(model=model, batch_running=n) for model, n in running.items()])

    nodes = [node("a", busy=2, idle=0), node("b", idle=0)]
    assert batch_running(nodes, "busy")
    assert not batch_running(nodes, "idle")
    assert not batch_running(nodes, "unknown")
