"""The engine's op dispatch: torch on CPU by default, chosen once per engine from
`EngineConfig.kernels` (the worker's HELEXA_KERNELS), and the Triton path (forced, run by Triton's
interpreter here) giving the same logits and greedy tokens as the torch path on tiny models."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from engine.core.engine_core import EngineCore
from engine.frontend.engine_config import EngineConfig
from engine.frontend.tokenizer import Tokenizer
from engine.loading.loader import Checkpoint
from engine.loading.model_config import ModelConfig
from engine.models import build_model
from engine.runner import ops
from helexa_kernels import cpu as cpu_kernels
from tests.engine.helpers import PagedSequences, perturb_norms_and_biases
from tests.kernels.helpers import DEVICE, assert_close

VOCAB = 96


def _tiny_model(model_type: str, device: str = DEVICE) -> torch.nn.Module:
    torch.manual_seed(0)
    config = ModelConfig(model_type=model_type, vocab_size=VOCAB, hidden_size=32,
                         intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         rope_theta=1e4, tie_word_embeddings=model_type == "llama")
    model = build_model(config).to(device).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)  # larger than HF's init, so logits have clear margins
    perturb_norms_and_biases(model)
    return model


@torch.inference_mode()
def _run(model: torch.nn.Module) -> tuple[torch.Tensor, list[list[int]]]:
    """Two prompts, one prefilled in two chunks beside the other's whole prefill, then a few
    batched greedy decode steps; returns (all logits, the greedy tokens of each sequence)."""
    prompts = [[5, 17, 3, 44, 9, 61, 2], [70, 8, 8, 31, 12]]
    steps = 3
    seqs = PagedSequences(model, [len(p) + steps for p in prompts], block_size=4)
    logits = seqs.step({0: prompts[0][:4], 1: prompts[1]})
    logits += seqs.step({0: prompts[0][4:]})
    last = [logits[2][-1], logits[1][-1]]
    tokens: list[list[int]] = [[], []]
    for _ in range(steps):
        nxt = [int(x.argmax()) for x in last]
        for i, t in enumerate(nxt):
            tokens[i].append(t)
        out = seqs.step({0: [nxt[0]], 1: [nxt[1]]})
        logits += out
        last = [out[0][-1], out[1][-1]]
    return torch.cat(logits), tokens


def test_cpu_kernels_on_cpu_triton_on_cuda_by_default() -> None:
    assert ops.backend_for("cpu") == "cpu"
    assert ops.backend_for(torch.device("cuda", 0)) == "triton"
    assert ops.use_backend("torch") == "torch"
    assert ops.backend_for("cuda") == "torch"
    assert ops.use_backend("triton") == "triton"
    assert ops.backend_for("cpu") == "triton"
    # An engine resolves auto once, for its own device.
    assert ops.use_backend("auto", torch.device("cuda")) == "triton"
    assert ops.backend_for("cpu") == "triton"
    assert ops.use_backend("auto", "cpu") == "cpu"
    assert ops.backend_for("cuda") == "cpu"


def test_a_bad_setting_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from apps.settings import WorkerSettings

    with pytest.raises(ValueError, match="kernels must be one of auto, torch, triton, cpu, got 'cuda'"):
        EngineConfig(model="m", kernels="cuda")
    with pytest.raises(ValueError, match="got 'cuda'"):
        ops.use_backend("cuda")
    monkeypatch.setenv("HELEXA_KERNELS", "cuda")
    with pytest.raises(ValueError, match="HELEXA_KERNELS must be one of auto, torch, triton, cpu"):
        WorkerSettings()


def test_the_worker_setting_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from apps.settings import WorkerSettings

    assert WorkerSettings().engine_config("m").kernels == "auto"
    monkeypatch.setenv("HELEXA_KERNELS", "Triton")
    assert WorkerSettings().engine_config("m").kernels == "triton"


def test_the_core_resolves_the_choice_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a core sets the ops' backend from its config; the environment is never read."""
    model = _tiny_model("qwen3", "cpu")
    checkpoint = Checkpoint(config=model.config, model=model, model_id="tiny",
                            tokenizer=Tokenizer(HFTokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                                bos_token_id=None, eos_token_id=None))
    monkeypatch.setenv("HELEXA_KERNELS", "triton")
    EngineCore(checkpoint, EngineConfig(model="in-memory", num_kv_blocks=8))
    assert ops.backend_for("cpu") == "cpu" and ops.backend_for("cuda") == "cpu"
    EngineCore(checkpoint, EngineConfig(model="in-memory", num_kv_blocks=8, kernels="torch"))
    assert ops.backend_for("cpu") == "torch"
    EngineCore(checkpoint, EngineConfig(model="in-memory", num_kv_blocks=8, kernels="triton"))
    assert ops.backend_for("cpu") == "triton"


def test_importing_the_engine_does_not_import_triton() -> None:
    """Triton decides interpreter or GPU when it is first imported (the kernel tests set
    TRITON_INTERPRET before that), and a CPU engine has no use for it."""
    code = ("import sys, engine.runner.ops, engine.core.engine_core, helexa_kernels.rmsnorm, "
            "helexa_kernels.gated_delta_rule; print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_torch_path_never_touches_triton_on_cpu() -> None:
    ops.triton_module.cache_clear()
    model = _tiny_model("qwen3", "cpu")
    _run(model)
    assert ops.triton_module.cache_info().currsize == 0


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_cpu_kernels_match_torch_path(model_type: str) -> None:
    """The C++ CPU kernels (norms, rotary, decode attention) against the PyTorch forms, over
    chunked prefill and decode; and `torch` really leaves them out."""
    model = _tiny_model(model_type, "cpu")
    ops.use_backend("torch")
    torch_logits, torch_tokens = _run(model)
    ops.use_backend("cpu")
    calls = []
    real = cpu_kernels.paged_decode_attention
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_kernels, "paged_decode_attention", lambda *a: calls.append(1) or real(*a))
        cpu_logits, cpu_tokens = _run(model)
    assert calls, "the decode kernel never ran"
    assert_close(cpu_logits, torch_logits, 1e-4, "logits")
    assert cpu_tokens == torch_tokens


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_triton_path_matches_torch_path(model_type: str) -> None:
    model = _tiny_model(model_type)
    ops.use_backend("torch")
    torch_logits, torch_tokens = _run(model)
    ops.use_backend("triton")
    ops.triton_module.cache_clear()
    triton_logits, triton_tokens = _run(model)
    # The four ops the dense models route (norms, the attention prologue: q/k norms, rotary
    # and the KV store in one kernel; silu_and_mul, attention) each loaded its Triton module.
    assert ops.triton_module.cache_info().currsize == 4
    assert_close(triton_logits, torch_logits, 1e-4, "logits")
    assert triton_tokens == torch_tokens


def test_triton_path_splits_small_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of two sequences over a handful of keys, split into key ranges (split-K, as
    small batches run on a GPU), give the torch path's logits and tokens."""
    from helexa_kernels.paged_attention import triton as paged_triton

    model = _tiny_model("qwen3")
    ops.use_backend("torch")
    torch_logits, torch_tokens = _run(model)
    ops.use_backend("triton")
    monkeypatch.setattr(paged_triton, "MIN_SPLIT_KEYS", 1)  # split even a few keys
    splits: list[int] = []
    real = paged_triton._split_decode
    monkeypatch.setattr(paged_triton, "_split_decode",
                        lambda *args: splits.append(args[-3]) or real(*args))
    triton_logits, triton_tokens = _run(model)
    assert splits and min(splits) > 1, "no decode step was split"
    assert_close(triton_logits, torch_logits, 1e-4, "logits")
    assert triton_tokens == torch_tokens


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5"])
def test_cpu_kernels_match_torch_path_for_hybrids(model_type: str, tmp_path) -> None:
    """The hybrids' gated attention and (1 + w) norms through the C++ CPU kernels."""
    import transformers

    from engine.loading.loader import load_checkpoint
    from tests.engine.hybrid_models import save_hybrid_dir

    model = load_checkpoint(save_hybrid_dir(transformers, model_type, tmp_path / model_type)).model
    ops.use_backend("torch")
    torch_logits, torch_tokens = _run(model)
    ops.use_backend("cpu")
    cpu_logits, cpu_tokens = _run(model)
    assert_close(cpu_logits, torch_logits, 1e-4, "logits")
    assert cpu_tokens == torch_tokens


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5"])
def test_triton_path_matches_torch_path_for_hybrids(model_type: str, tmp_path) -> None:
    """The hybrid models reach the GDN ops (conv, gating, delta rule), the gated and (1+w)
    norms and MoE through `engine.runner.ops` too; both paths agree over chunked prefill and decode."""
    import transformers

    from engine.loading.loader import load_checkpoint
    from tests.engine.hybrid_models import save_hybrid_dir

    model = load_checkpoint(save_hybrid_dir(transformers, model_type, tmp_path / model_type)).model.to(DEVICE)
    ops.use_backend("torch")
    torch_logits, torch_tokens = _run(model)
    ops.use_backend("triton")
    ops.triton_module.cache_clear()
    triton_logits, triton_tokens = _run(model)
    loaded = ops.triton_module.cache_info().currsize
    # norms, the attention prologue, attention, silu_and_mul, conv, gating, the delta rule
    # (and MoE for qwen3_next)
    assert loaded >= 7, f"only {loaded} Triton op modules were used"
    assert_close(triton_logits, torch_logits, 1e-4, "logits")
    assert triton_tokens == torch_tokens
