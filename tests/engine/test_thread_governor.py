"""The CPU thread governor: it moves to the count whose decode steps measure faster, only on pairs
of steps of the same batch, and an engine whose thread count moves mid-run gives the same tokens."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from apps.bus import wire
from apps.gateway.metrics import GatewayMetrics
from engine.core.engine_core import EngineCore
from engine.cpu.thread_governor import ThreadGovernor
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import EngineRequest, SamplingParams
from engine.loading.loader import Checkpoint
from tests.engine.helpers import run_all


class Machine:
    """Steps whose seconds are a function of the thread count set (what the governor measures)."""

    def __init__(self, seconds: Callable[[int], float]) -> None:
        self.seconds = seconds
        self.threads = 0
        self.sets: list[int] = []
        self.steps_on: dict[int, int] = {}

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def run(self, governor: ThreadGovernor, rows: int | None) -> None:
        threads = governor.begin(rows)
        assert threads == (self.threads or governor.max_threads)
        self.steps_on[threads] = self.steps_on.get(threads, 0) + 1
        governor.end(self.seconds(threads))


def test_moves_to_the_faster_count_and_back_when_the_machine_changes() -> None:
    busy = True
    machine = Machine(lambda n: {1: 0.043, 2: 0.066 if busy else 0.030}[n])
    governor = ThreadGovernor(2, interval=20, probe_pairs=4, set_threads=machine.set_threads)
    for _ in range(40):
        machine.run(governor, 4)
    assert governor.current == 1
    busy = False
    for _ in range(200):  # the probes that kept 1 thread meanwhile spaced the next ones out
        machine.run(governor, 4)
    assert governor.current == 2
    assert [(a, b) for _, a, b, _ in governor.moves] == [(2, 1), (1, 2)]


def test_stays_when_the_other_count_is_not_faster_and_probes_cost_few_steps() -> None:
    machine = Machine(lambda n: {1: 0.043, 2: 0.030, 3: 0.031}[n])
    governor = ThreadGovernor(3, interval=50, probe_pairs=4, set_threads=machine.set_threads)
    for _ in range(1000):
        machine.run(governor, 8)
    assert governor.current == 3
    assert governor.moves == []
    # 2 is within the margin of 3, so every probe goes down and stays; 1 is never tried.
    assert set(machine.steps_on) == {2, 3}
    assert machine.steps_on[2] <= 4 * (1000 // 50 + 1)


def test_pairs_only_steps_of_the_same_batch() -> None:
    # A step's seconds follow its rows alone: a pair across batch sizes would see a faster count.
    generator = random.Random(0)
    governor = ThreadGovernor(2, interval=7, probe_pairs=2, set_threads=lambda n: None)
    tried = 0
    for _ in range(2000):
        rows = generator.randint(1, 4)
        tried += governor.begin(rows) == 1
        governor.end(0.01 * rows)
    assert tried > 100
    assert governor.current == 2 and governor.moves == []


def test_other_steps_run_on_the_current_count_and_are_not_measured() -> None:
    machine = Machine(lambda n: {1: 0.001, 2: 0.030}[n])
    governor = ThreadGovernor(2, interval=5, probe_pairs=2, set_threads=machine.set_threads)
    for _ in range(100):
        machine.run(governor, None)
    assert governor.decode_steps == 0
    assert machine.steps_on == {2: 100}
    governor.restore()
    assert machine.sets == []


def test_restore_gives_back_the_starting_count() -> None:
    machine = Machine(lambda n: {1: 0.01, 2: 0.03}[n])
    governor = ThreadGovernor(2, interval=2, probe_pairs=1, set_threads=machine.set_threads)
    for _ in range(10):
        machine.run(governor, 1)
    assert governor.current == 1
    governor.restore()
    assert machine.sets[-1] == 2 and governor.current == 2


def test_an_engine_whose_threads_move_mid_run_gives_the_same_tokens(smollm2: Checkpoint,
                                                                   chat_prompt_ids: list[int]) -> None:
    torch.set_num_threads(2)  # whatever the machine: the governor needs two counts to move between
    prompts = [chat_prompt_ids, chat_prompt_ids[:-3], chat_prompt_ids[2:]]

    def requests() -> list[EngineRequest]:
        return [EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
                for i, prompt in enumerate(prompts)]

    config = EngineConfig(model="m", max_num_seqs=4, enable_prefix_caching=False)
    steady = EngineCore(smollm2, config)
    assert steady.runner.thread_governor is not None
    steady.runner.thread_governor = None
    expected = run_all(steady, requests())

    moving = EngineCore(smollm2, config)
    assert moving.runner.thread_governor is not None
    started = torch.get_num_threads()
    counts: list[int] = []

    def record(n: int) -> None:
        counts.append(n)
        torch.set_num_threads(n)

    # Every other decode step probes, and each probe moves (a margin no step can miss).
    governor = ThreadGovernor(started, first_probe=1, interval=1, probe_pairs=1, margin=-1e9, set_threads=record)
    moving.runner.thread_governor = governor
    try:
        got = run_all(moving, requests())
    finally:
        moving.close()
    assert {k: tokens for k, (tokens, _) in got.items()} == {k: tokens for k, (tokens, _) in expected.items()}
    assert len(governor.moves) >= 4 and started - 1 in counts
    assert torch.get_num_threads() == started


def test_a_many_core_count_moves_by_a_quarter_toward_the_faster_count() -> None:
    # A process allowed 4 of 32 cores: steps slow with every thread over 4.
    machine = Machine(lambda n: 0.010 * max(1.0, n / 4))
    governor = ThreadGovernor(32, interval=10, probe_pairs=2, set_threads=machine.set_threads)
    for _ in range(400):
        machine.run(governor, 2)
    assert [(a, b) for _, a, b, _ in governor.moves][:3] == [(32, 24), (24, 18), (18, 14)]
    assert governor.current <= 5


def test_slow_steps_bring_the_next_probe_sooner_than_the_step_interval() -> None:
    machine = Machine(lambda n: {1: 0.05, 2: 1.0}[n])
    governor = ThreadGovernor(2, first_probe=16, interval=100, interval_s=5.0, probe_pairs=2,
                              set_threads=machine.set_threads)
    for _ in range(12):
        machine.run(governor, 1)
    # Five 1-second steps reached interval_s; the probe's two pairs took four more.
    assert governor.moves and governor.moves[0][:3] == (9, 2, 1)


def test_the_first_probe_comes_after_first_probe_steps() -> None:
    machine = Machine(lambda n: {1: 0.01, 2: 0.03}[n])
    governor = ThreadGovernor(2, first_probe=16, interval=100, probe_pairs=2, set_threads=machine.set_threads)
    for _ in range(16):
        machine.run(governor, 1)
    assert machine.steps_on == {2: 16}
    for _ in range(4):
        machine.run(governor, 1)
    assert governor.moves[0][:3] == (20, 2, 1)


def test_probes_that_keep_the_count_come_less_often_and_a_move_resets_them() -> None:
    faster = 2
    machine = Machine(lambda n: 0.01 if n == faster else 0.02)
    governor = ThreadGovernor(2, first_probe=10, interval=10, max_backoff=4, probe_pairs=1,
                              set_threads=machine.set_threads)
    probes_at = []
    for step in range(200):
        before = machine.steps_on.get(1, 0)
        machine.run(governor, 1)
        if machine.steps_on.get(1, 0) > before:
            probes_at.append(step)
    # A probe is two steps (one pair), its second on the other count: the first begins after 10
    # steps, the next ones 20, 40, 40 ... steps after the one before ended.
    assert probes_at[:5] == [11, 33, 75, 117, 159]
    assert governor.backoff == 4
    faster = 1
    for _ in range(100):
        machine.run(governor, 1)
        if governor.moves:
            break
    assert governor.current == 1 and governor.backoff == 1


def test_the_count_the_steps_run_on_reaches_the_stats_and_the_gateways_metrics(smollm2: Checkpoint,
                                                                              chat_prompt_ids: list[int]) -> None:
    torch.set_num_threads(2)
    core = EngineCore(smollm2, EngineConfig(model="m", max_num_seqs=2, enable_prefix_caching=False))
    # Every other decode step probes, and each probe moves: the count goes 2, 1, 2, ...
    core.runner.thread_governor = ThreadGovernor(2, first_probe=1, interval=1, probe_pairs=1, margin=-1e9)
    core.add_request(EngineRequest("r", chat_prompt_ids, SamplingParams(max_tokens=12, temperature=0.0,
                                                                       ignore_eos=True)))
    seen: list[int] = []
    try:
        while core.has_work():
            core.step()
            seen.append(core.stats.cpu_threads)
    finally:
        core.close()
    assert {1, 2} <= set(seen), seen
    node = wire.NodeStatus(node="n1", version="test", models=[wire.ModelStatus(model="m", cpu_threads=seen[-1])])
    text = GatewayMetrics().render([node], {}).decode()
    assert f'helexa:engine_cpu_threads{{model="m",node="n1"}} {float(seen[-1])}' in text, text
