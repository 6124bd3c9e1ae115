"""The bench configuration: a TOML file read into msgspec Structs, with scenario names checked up front.

A config names targets (OpenAI-compatible base URLs, ours or a peer's), the models to bench on each,
the scenarios and how many samples each takes. Scenario names are parsed here, once, so a typo fails
before any request is sent.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import msgspec


class ConfigError(ValueError):
    """The bench config cannot be used; the message says which field and why."""


class Target(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    base_url: str
    api_key: str | None = None
    # Models benched on this target; empty means the config's top-level `models`.
    models: list[str] = []
    # The bus of the target's helexa workers; only `swap` needs it (model control goes over NATS).
    nats_url: str | None = None


class Capability(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A fixed prompt whose answer is kept as an artifact and scored later (`helexa bench score`)."""

    name: str
    prompt: str
    max_tokens: int = 512


class BenchConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    targets: list[Target]
    scenarios: list[str]
    models: list[str] = []
    capabilities: list[Capability] = []
    samples: int = 3
    max_tokens: int = 128
    # Streams per burst are fixed by `concurrency:<n>`; this is the prompt size each stream sends.
    concurrency_prompt_tokens: int = 256
    timeout_s: float = 300.0
    swap_timeout_s: float = 600.0

    def models_for(self, target: Target) -> list[str]:
        return list(target.models or self.models)


@dataclass(slots=True, frozen=True)
class ScenarioSpec:
    """One parsed scenario name: `chat:<prompt_tokens>`, `concurrency:<n>`, `capability:<name>`,
    `swap`, or `context:<t1>,<t2>,...` (the context ladder, smallest to largest)."""

    kind: str
    name: str
    size: int = 0
    rungs: tuple[int, ...] = ()
    capability: str = ""


def _positive(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"scenario {name!r}: {raw!r} is not a whole number") from None
    if value < 1:
        raise ConfigError(f"scenario {name!r}: {value} must be at least 1")
    return value


def parse_scenario(name: str, capabilities: list[Capability]) -> ScenarioSpec:
    kind, _, arg = name.partition(":")
    if kind == "swap" and not arg:
        return ScenarioSpec("swap", name)
    if kind in ("chat", "concurrency") and arg:
        return ScenarioSpec(kind, name, size=_positive(name, arg))
    if kind == "context" and arg:
        rungs = tuple(sorted({_positive(name, part.strip()) for part in arg.split(",")}))
        if len(rungs) < 2:
            raise ConfigError(f"scenario {name!r}: the context ladder needs at least two sizes")
        return ScenarioSpec("context", name, rungs=rungs)
    if kind == "capability" and arg:
        if arg not in {c.name for c in capabilities}:
            raise ConfigError(f"scenario {name!r}: no [[capabilities]] entry named {arg!r}")
        return ScenarioSpec("capability", name, capability=arg)
    raise ConfigError(
        f"unknown scenario {name!r}: use chat:<tokens>, concurrency:<n>, capability:<name>, swap "
        "or context:<tokens>,<tokens>,..."
    )


def validate(config: BenchConfig) -> list[ScenarioSpec]:
    """The parsed scenarios, after checking everything a run would otherwise trip over midway."""
    if not config.targets:
        raise ConfigError("at least one [[targets]] entry is needed")
    if not config.scenarios:
        raise ConfigError("`scenarios` is empty")
    if config.samples < 1 or config.max_tokens < 1 or config.concurrency_prompt_tokens < 1:
        raise ConfigError("samples, max_tokens and concurrency_prompt_tokens must be at least 1")
    if config.timeout_s <= 0 or config.swap_timeout_s <= 0:
        raise ConfigError("timeouts must be positive")
    names = [t.name for t in config.targets]
    if len(set(names)) != len(names):
        raise ConfigError("target names must be unique")
    for target in config.targets:
        if not config.models_for(target):
            raise ConfigError(f"target {target.name!r} has no models (set `models` on it or at the top)")
    if len({c.name for c in config.capabilities}) != len(config.capabilities):
        raise ConfigError("capability names must be unique")
    return [parse_scenario(name, config.capabilities) for name in config.scenarios]


def load_config(path: str | Path) -> tuple[BenchConfig, list[ScenarioSpec]]:
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        config = msgspec.convert(raw, BenchConfig)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config, validate(config)
