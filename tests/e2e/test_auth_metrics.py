"""API keys (401s, principals into the ledger, keys never logged) and the /metrics families."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from openai import AuthenticationError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from apps.embedded import free_port
from tests.e2e.conftest import System
from tests.e2e.test_chat import finished_run
from tests.support import AppProcess

ALICE_KEY = "sk-alice-0123456789abcdef"
# A principal only the prefix-cache test sends as: nothing of its own is cached before it.
CAROL_KEY = "sk-carol-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed_gateway(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, AppProcess]]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# key principal\n{ALICE_KEY} alice\nsk-bob-secret bob\n{CAROL_KEY} carol\n")
    port = free_port()
    gateway = AppProcess(["gateway"], {**system.env_for("gateway"), "HELEXA_PORT": str(port),
                                       "HELEXA_API_KEYS": str(keys)})
    try:
        gateway.wait_ready()
        yield f"http://127.0.0.1:{port}", gateway
    finally:
        gateway.stop()


QUESTION = [{"role": "user", "content": "Say hi."}]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic x"}],
                         ids=["missing", "wrong", "not-bearer"])
def test_missing_or_wrong_key_is_401(system: System, keyed_gateway: tuple[str, AppProcess], headers: dict) -> None:
    url, _ = keyed_gateway
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": system.model, "messages": QUESTION},
                          headers=headers, timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200, "health needs no key"


def test_the_principal_reaches_the_ledger_and_the_key_no_log(system: System,
                                                             keyed_gateway: tuple[str, AppProcess]) -> None:
    url, gateway = keyed_gateway
    client = OpenAI(base_url=f"{url}/v1", api_key=ALICE_KEY, max_retries=0)
    response = client.chat.completions.create(model=system.model, messages=QUESTION, max_tokens=4, temperature=0)
    row = asyncio.run(finished_run(system, response.id))
    assert row["principal"] == "alice"
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{url}/v1", api_key="sk-nope", max_retries=0).models.list()
    assert ALICE_KEY not in gateway.output() and "sk-nope" not in gateway.output()


def test_the_prefix_cache_is_shared_within_a_principal_and_never_across(
        system: System, keyed_gateway: tuple[str, AppProcess]) -> None:
    """Carol sending alice's prompt word for word reuses none of her KV (nor learns from
    `cached_tokens` that she sent it); each principal's own repeat is a hit past the chat template's
    opening (which alice's earlier requests in this module may have cached for her already)."""
    url, _ = keyed_gateway
    prompt = [{"role": "user", "content": "A prompt only this test sends: " + " ".join(
        f"item{i}" for i in range(60)) + ". Which item comes first?"}]

    def cached(key: str) -> int:
        client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=system.model, messages=prompt, max_tokens=2, temperature=0)
        assert reply.usage.prompt_tokens > 128
        return reply.usage.prompt_tokens_details.cached_tokens

    cached(ALICE_KEY)
    assert cached(ALICE_KEY) > 96
    assert cached(CAROL_KEY) == 0
    assert cached(CAROL_KEY) > 96


def test_metrics_expose_the_named_families(system: System) -> None:
    client = OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0)
    for _ in range(2):
        list(client.chat.completions.create(model=system.model, messages=QUESTION, max_tokens=5, temperature=0,
                                            stream=True))
    text = httpx.get(f"{system.base_url}/metrics", timeout=30).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"model": system.model, **labels}.items())))]

    assert value("helexa:time_to_first_token_seconds_count") >= 2
    assert value("helexa:inter_token_latency_seconds_count") >= 2
    assert value("helexa:e2e_request_latency_seconds_count") >= 2
    assert value("helexa:request_queue_time_seconds_count") >= 2
    assert value("helexa:generation_tokens_total") >= 10
    assert value("helexa:prompt_tokens_total") > 0
    assert value("helexa:request_success_total", finished_reason="length") >= 2
    assert 0.0 <= value("helexa:kv_cache_usage_perc") <= 1.0
    assert value("helexa:num_requests_running") >= 0
    assert ("helexa:prefix_cache_queries_total", (("model", system.model),)) in samples
