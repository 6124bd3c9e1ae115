"""Turn a path on disk into a ready model: config, weights in an `nn.Module`, tokenizer, model id.

Two sources: a `.gguf` file (see `engine.loading.gguf_file` and `engine.loading.gguf_import`) or an
HF model directory (config.json, *.safetensors, tokenizer.json). Both end in the same
`load_weights`, which insists every parameter is filled exactly once. Nothing is ever downloaded.
Given a `Shard` of a tensor-parallel group, an HF directory is read one rank's slice at a time
(`shard_reader`): no rank ever holds a whole sharded tensor. A GGUF file's tensors are quantized in
blocks, so each rank dequantizes one tensor at a time (its q/k rows un-permuted per head first),
keeps its slice and drops the rest: no rank holds the whole model, only one tensor in passing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.frontend.model_source import is_gguf, model_id
from engine.frontend.tokenizer import Tokenizer
from engine.loading import gguf_import
from engine.loading.gguf_file import GGUFFile, read_config, read_tokenizer
from engine.loading.model_config import ModelConfig
from engine.models import get_model_class
from engine.models.layers import PackedLinear
from engine.models.parallel_layers import Shard, Split, refuse_indivisible, shard_slices, split_of

# Reads one checkpoint tensor from a safetensors slice: (name, slice) -> tensor.
SliceReader = Callable[[str, object], torch.Tensor]


@dataclass(slots=True)
class Checkpoint:
    config: ModelConfig
    model: nn.Module
    tokenizer: Tokenizer
    model_id: str


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", shard: Shard | None = None) -> Checkpoint:
    """Load a `.gguf` file or an HF model directory (one tensor-parallel rank's part of it when
    `shard` has more than one rank); the model comes back in eval mode."""
    path = Path(path)
    shard = shard or Shard()
    if is_gguf(path):
        return _load_gguf(path, dtype, device, shard)
    if path.is_dir():
        return _load_hf_dir(path, dtype, device, shard)
    raise FileNotFoundError(f"{path} is neither a .gguf file nor a model directory")


def read_model_config(path: str | Path) -> ModelConfig:
    """The architecture alone (no weights): what the dtype measurement needs before loading."""
    path = Path(path)
    if is_gguf(path):
        return read_config(GGUFFile(path))
    return ModelConfig.from_hf_config(json.loads((path / "config.json").read_text(encoding="utf-8")))


def weights_bytes(path: str | Path) -> int:
    """How many bytes of weights a source holds on disk (0 where it cannot tell): for the log line
    that says a load has started."""
    path = Path(path)
    try:
        if is_gguf(path):
            return path.stat().st_size
        return sum(file.stat().st_size for file in _safetensors_files(path))
    except (OSError, ValueError, KeyError):
        return 0


class WholeTensor:
    """A dequantized tensor read the way `shard_reader` reads a safetensors slice."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        return self.tensor[index]  # type: ignore[index]


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device | str, shard: Shard) -> Checkpoint:
    gguf = GGUFFile(path)
    config = read_config(gguf)
    model = empty_model(config, dtype, device, shard)
    weights = gguf_import.iter_weights(gguf, config, dtype)
    read = shard_reader(model, shard)
    if read is not None:
        weights = ((name, read(name, WholeTensor(tensor)).to(dtype)) for name, tensor in weights)
    load_weights(model, weights)
    return Checkpoint(config=config, model=model.eval(), tokenizer=read_tokenizer(gguf), model_id=model_id(path))


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device | str, shard: Shard) -> Checkpoint:
    raw_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if raw_config.get("quantization_config"):
        raise NotImplementedError(f"{path}: quantized HF checkpoints are not supported")
    config = ModelConfig.from_hf_config(raw_config)
    model = empty_model(config, dtype, device, shard)
    load_weights(model, iter_safetensors(path, dtype, shard_reader(model, shard)))
    return Checkpoint(config=config, model=model.eval(), tokenizer=Tokenizer.from_hf_dir(path), model_id=model_id(path))


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                shard: Shard | None = None) -> nn.Module:
    """Build on the meta device (no random init of weights about to be overwritten), then
    allocate uninitialized storage; load_weights checks that every parameter gets filled. With a
    `shard` of several ranks: that rank's part, refused in one line where the shapes do not divide."""
    model_class = get_model_class(config.model_type)
    shard = shard or Shard()
    with torch.device("meta"):
        if shard.world == 1:
            model = model_class(config)
        else:
            refuse_indivisible(config, shard.world)
            model = model_class(config, shard)
    model = model.to(dtype=dtype).to_empty(device=device)
    # to_empty gives tied parameters separate storage; share it again.
    model.tie_weights()
    return model


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    return files


def iter_safetensors(path: Path, dtype: torch.dtype,
                     read: SliceReader | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name) if read is None else read(name, f.get_slice(name))
                yield name, tensor.to(dtype)


def shard_reader(model: nn.Module, shard: Shard) -> SliceReader | None:
    """How one rank reads each checkpoint tensor: its slice along the dimension it is cut on
    (`engine.models.parallel_layers.split_of`: the checkpoint name where a module declares it,
    else the parameter it fills), each section's slice where the dimension is several side by side,
    zeros for a bias only rank 0 adds, whole for a replicated one (norms). None at world 1."""
    if shard.world == 1:
        return None
    packed = packed_targets(model)
    # A family whose checkpoints nest its tensors under another prefix says how it names them.
    rename: Callable[[str], str] = getattr(model, "checkpoint_name", lambda name: name)

    def read(name: str, piece: object) -> torch.Tensor:
        name = rename(name)
        split = split_of(model, name)
        if split == Split(None) and name in packed:
            split = split_of(model, packed[name][0])
        shape = piece.get_shape()  # a safetensors slice
        if split.rank0_only and shard.rank != 0:
            return torch.zeros(shape)
        if split.dim is None:
            return piece[:]  # type: ignore[index]
        parts = [piece[index] for index in shard_slices(shape, split, shard)]  # type: ignore[index]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=split.dim)

    return read


def packed_targets(model: nn.Module) -> dict[str, tuple[str, slice]]:
    """Where each packed shard's checkpoint tensors go: every `PackedLinear` maps its shards'
    names (`...self_attn.q_proj.weight`, `.bias`) to its own parameter and the shard's rows."""
    mapping: dict[str, tuple[str, slice]] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, PackedLinear):
            continue
        parent = module_name.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        offset = 0
        for shard, rows in module.shards.items():
            for kind in ("weight", "bias"):
                mapping[f"{prefix}{shard}.{kind}"] = (f"{module_name}.{kind}", slice(offset, offset + rows))
            offset += rows
    return mapping


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy named tensors into the model's parameters; error on unknown, misshapen or missing.

    A model whose checkpoints name or cut tensors differently from its parameters (per-expert
    tensors stacked into one, fused projections split, a nested prefix) provides
    `checkpoint_targets(name, tensor) -> [(param_name, index, tensor), ...]`: each piece is
    copied into `param[index]` (an empty list skips the tensor). Then the packed-module mapping
    (`packed_targets`) sends the pieces of packed projections (q/k/v, gate/up, ...) to their rows
    of the packed parameter. A parameter counts as filled once pieces covering all of its
    elements have arrived, and never more than that.
    """
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    all_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied_aliases = all_names - set(params)
    targets = getattr(model, "checkpoint_targets", None)
    packed = packed_targets(model)
    filled: dict[str, int] = {}
    with torch.no_grad():
        for name, tensor in weights:
            if name in tied_aliases or name.endswith("rotary_emb.inv_freq"):
                continue  # a tied copy some checkpoints save anyway; RoPE tables we compute
            pieces = targets(name, tensor) if targets is not None else [(name, (), tensor)]
            for param_name, index, piece in pieces:
                if param_name in packed and param_name not in params:
                    param_name, rows = packed[param_name]
                    if index != ():
                        raise ValueError(f"checkpoint tensor {name!r}: a packed shard takes whole tensors")
                    index = (rows,)
                if param_name in tied_aliases:
                    continue
                if param_name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
                try:
                    destination = params[param_name][index]
                except IndexError:
                    raise ValueError(f"checkpoint tensor {name!r} does not fit {param_name!r} "
                                     f"{tuple(params[param_name].shape)}") from None
                if destination.shape != piece.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(piece.shape)} "
                                     f"!= model shape {tuple(destination.shape)}")
                destination.copy_(piece)
                filled[param_name] = filled.get(param_name, 0) + piece.numel()
                if filled[param_name] > params[param_name].numel():
                    raise ValueError(f"checkpoint fills {param_name!r} more than once")
    missing = sorted(n for n, p in params.items() if filled.get(n, 0) != p.numel())
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
