"""Hypothesis throws odd bodies at every generation endpoint: never a 5xx, never a hang."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import System

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=8)
roles = st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot", 7])
messages = st.lists(st.fixed_dictionaries({"role": roles}, optional={"content": st.one_of(
    st.text(max_size=30), st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                          "text": st.text(max_size=10)}), max_size=2),
    json_values)}), max_size=3)
knobs = {
    "max_tokens": st.one_of(st.integers(-2, 6), json_values),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False, allow_infinity=False), json_values),
    "top_p": st.floats(-0.5, 1.5, allow_nan=False, allow_infinity=False),
    "top_k": st.integers(-3, 50),
    "n": st.integers(-1, 3),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5)),
    "stream": st.booleans(),
    "seed": st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=3)),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
    "max_completion_tokens": st.integers(-1, 6),
}


def bodies(model: str, main: str, main_strategy: st.SearchStrategy) -> st.SearchStrategy:
    models = st.sampled_from([model, "no-such-model", "", 3])
    return st.one_of(
        st.fixed_dictionaries({"model": models, main: main_strategy}, optional=knobs),
        st.dictionaries(st.text(max_size=10), json_values, max_size=4),
        json_values,
    )


def check(system: System, path: str, body: object) -> None:
    with httpx.Client(base_url=system.base_url, timeout=60) as http:
        response = http.post(path, json=body)
        assert response.status_code < 500, (path, body, response.status_code, response.text)
        if response.status_code >= 400:
            assert "Traceback" not in response.text


FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def test_chat_completions_fuzz(system: System) -> None:
    @FUZZ
    @given(bodies(system.model, "messages", messages))
    def run(body: object) -> None:
        check(system, "/v1/chat/completions", body)

    run()


def test_completions_fuzz(system: System) -> None:
    @FUZZ
    @given(bodies(system.model, "prompt", st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 60000), max_size=4),
                                                   json_values)))
    def run(body: object) -> None:
        check(system, "/v1/completions", body)

    run()


def test_messages_fuzz(system: System) -> None:
    @FUZZ
    @given(bodies(system.model, "messages", messages))
    def run(body: object) -> None:
        check(system, "/v1/messages", body)

    run()
