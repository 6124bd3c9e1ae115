"""The scripted engine keeps the real engine's request rules: a second stream under a live request
id is refused with an error output, and the first stream is untouched."""

from __future__ import annotations

import json
from pathlib import Path

from engine.frontend.model_source import load_tokenizer
from engine.frontend.protocol import EngineRequest, FinishReason, SamplingParams
from engine.frontend.scripted import ScriptedEngine
from engine.loading.default_model import default_model_path


async def test_a_duplicate_id_is_refused_and_the_first_stream_goes_on(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default": "one two three four"}))
    tokenizer, model_id = load_tokenizer(default_model_path())
    engine = ScriptedEngine(script, tokenizer, model_id)
    request = EngineRequest("twice", tokenizer.encode("hello"), SamplingParams(max_tokens=32))
    first = engine.generate(request)
    outputs = [await first.__anext__()]
    refused = [out async for out in engine.generate(request)]
    assert len(refused) == 1 and refused[0].finish_reason is FinishReason.ERROR
    assert "duplicate" in refused[0].error
    assert engine.stats.num_running == 1
    outputs += [out async for out in first]
    assert outputs[-1].finish_reason is FinishReason.STOP
    text = tokenizer.decode([t for out in outputs for t in out.new_token_ids], skip_special_tokens=True)
    assert text == "one two three four"
    assert engine.stats.num_running == 0
