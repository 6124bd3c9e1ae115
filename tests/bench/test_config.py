"""Bench configs: TOML into Structs, scenario names parsed and bad configs refused before any request."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.bench.config import ConfigError, ScenarioSpec, load_config

GOOD = """
models = ["m1"]
scenarios = ["chat:128", "concurrency:4", "context:4096,128,1024", "capability:plan", "swap"]
samples = 2
max_tokens = 16

[[targets]]
name = "ours"
base_url = "http://127.0.0.1:8000/v1"

[[targets]]
name = "peer"
base_url = "http://peer:8000/v1"
api_key = "secret"
models = ["peer-model"]

[[capabilities]]
name = "plan"
prompt = "Write a plan."
max_tokens = 64
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bench.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_config_reads_into_targets_models_and_parsed_scenarios(tmp_path: Path) -> None:
    config, specs = load_config(write(tmp_path, GOOD))
    assert [config.models_for(t) for t in config.targets] == [["m1"], ["peer-model"]]
    assert config.targets[1].api_key == "secret"
    assert specs == [
        ScenarioSpec("chat", "chat:128", size=128),
        ScenarioSpec("concurrency", "concurrency:4", size=4),
        ScenarioSpec("context", "context:4096,128,1024", rungs=(128, 1024, 4096)),
        ScenarioSpec("capability", "capability:plan", capability="plan"),
        ScenarioSpec("swap", "swap"),
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('"swap"]', '"swap", "chat:abc"]'), "not a whole number"),
        (('"swap"]', '"swap", "concurrency:0"]'), "at least 1"),
        (('"swap"]', '"swap", "context:128"]'), "at least two sizes"),
        (('"swap"]', '"swap", "capability:nope"]'), "no \\[\\[capabilities\\]\\] entry named 'nope'"),
        (('"swap"]', '"swap", "latency"]'), "unknown scenario 'latency'"),
        (('samples = 2', 'samples = 0'), "at least 1"),
        (('models = ["m1"]', 'models = []'), "target 'ours' has no models"),
        (('name = "peer"', 'name = "ours"'), "target names must be unique"),
        (('max_tokens = 16', 'max_tokens = 16\nsample = 3'), "unknown field `sample`"),
        (('samples = 2', 'samples = "two"'), "Expected `int`"),
    ],
    ids=["chat-nan", "concurrency-zero", "one-rung", "missing-probe", "unknown", "no-samples", "no-models",
         "dup-target", "typo-field", "wrong-type"],
)
def test_bad_configs_fail_with_a_clear_message(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, GOOD.replace(*change, 1)))


def test_unreadable_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(write(tmp_path, "scenarios = ["))


def test_swap_without_model_control_fails_with_a_clear_message(tmp_path: Path) -> None:
    """`swap` needs our workers' model control over NATS; a target without it is refused by name."""
    import asyncio

    from apps.bench.client import http_client
    from apps.bench.scenarios import SWAP_UNAVAILABLE, BenchContext, run_scenario

    config, specs = load_config(write(tmp_path, GOOD))
    swap = next(s for s in specs if s.kind == "swap")

    async def run() -> str | None:
        async with http_client(config.targets[1].base_url, None) as http:
            outcome = await run_scenario(BenchContext(config, config.targets[1], "peer-model", http), swap)
        return outcome.error

    error = asyncio.run(run())
    assert error is not None and error.startswith(SWAP_UNAVAILABLE)
