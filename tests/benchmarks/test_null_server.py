"""The client-floor server (benchmarks/null_server.py), through the OpenAI SDK as the benchmark uses it."""

from __future__ import annotations

import pytest

from benchmarks.openai_load import OpenAILoad
from benchmarks.servers import free_port, null_server


@pytest.mark.parametrize("burst", [1, 3])
def test_each_stream_of_a_burst_gets_its_whole_answer_after_the_burst_is_in(burst: int) -> None:
    with null_server(free_port(), burst) as server, OpenAILoad(server.base_url, server.model) as load:
        result = load.run([[1, 2, 3]] * burst, 8, concurrent=True)
    assert len({s.response_id for s in result.streams}) == burst
    last_sent = max(s.sent_at for s in result.streams)
    for stream in result.streams:
        assert stream.text == " a" * 8 and stream.completion_tokens == 8
        assert stream.first is not None and stream.first >= last_sent  # held until the last was sent
