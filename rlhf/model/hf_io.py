"""HF model directories: config.json, safetensors (one file or sharded with an index), tokenizer files.

What we write is what released Qwen3-MoE or DeepSeek-V3 checkpoints hold, so transformers and vLLM open
it unchanged: per-expert tensor names (`model.layers.{l}.mlp.experts.{e}.gate_proj.weight`, ...), MTP
modules as the layers after the last, a config.json with `model_type: qwen3_moe` or `deepseek_v3`
(`rlhf.model.hf_config`). In memory our model keeps experts stacked (see
`rlhf.model.qwen3_moe`); `to_hf_tensors` / `from_hf_tensors` convert between the two, bit-exactly.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlhf.errors import ConfigError
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.model.hf_config import common_fields, deepseek_v3_config, model_config_from_deepseek_v3
from rlhf.schema import Architecture, DType, ModelConfig
from weight_sync.pieces import fill_buffers

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_TORCH_DTYPE = {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16, DType.float16: torch.float16}
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    return _TORCH_DTYPE[cfg.dtype]


def hf_config(cfg: ModelConfig) -> dict:
    """config.json contents, in the keys released checkpoints of the architecture use."""
    if cfg.architecture is Architecture.pangu_moe:
        return deepseek_v3_config(cfg)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.first_k_dense_layers)),
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": cfg.dtype.value,
        "use_cache": True,
    }


def model_config_from_hf(d: dict, name: str = "hf") -> ModelConfig:
    """Read a Qwen3-MoE or DeepSeek-V3 config.json back into our schema; refuses layouts we do not build."""
    if d.get("model_type") == "deepseek_v3":
        return model_config_from_deepseek_v3(d, name)
    if d.get("model_type") != "qwen3_moe":
        raise ValueError(f"config.json model_type={d.get('model_type')!r}: only qwen3_moe and deepseek_v3 directories "
                         "can be loaded")
    dense = d.get("mlp_only_layers") or []
    if dense != list(range(len(dense))) or d.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"config.json mlp_only_layers={dense}, decoder_sparse_step={d.get('decoder_sparse_step')}: "
                         "only dense-first layers (0..k-1) with decoder_sparse_step 1 are supported")
    rope = d.get("rope_parameters") or {}
    return ModelConfig(
        name=name,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"],
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        num_experts=d.get("num_experts") or d["num_local_experts"],
        num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"],
        norm_topk_prob=d.get("norm_topk_prob", False),
        first_k_dense_layers=len(dense),
        intermediate_size=d["intermediate_size"],
        rms_norm_eps=d["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        max_position_embeddings=d["max_position_embeddings"],
        **common_fields(d),
    )


def to_hf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Our state dict -> (HF checkpoint name, tensor) pairs; stacked experts become per-expert tensors."""
    I = cfg.moe_intermediate_size
    for name, t in state.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        m = _STACKED.match(name)
        if m is None:
            yield name, t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :I]
                yield f"{prefix}.{e}.up_proj.weight", t[e, I:]
            else:
                yield f"{prefix}.{e}.down_proj.weight", t[e]


def from_hf_tensors(tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """(HF name, tensor) pairs -> our state dict, stacking per-expert tensors. Every expert piece must come."""
    state: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in tensors:
        m = _PER_EXPERT.match(name)
        if m is None:
            state[name] = t
        else:
            prefix, e, kind = m.groups()
            pieces.setdefault(prefix, {})[(int(e), kind)] = t
    for prefix, parts in pieces.items():
        missing = [f"{prefix}.{e}.{k}.weight" for e in range(cfg.num_experts)
                   for k in ("gate_proj", "up_proj", "down_proj") if (e, k) not in parts]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} expert tensors, e.g. {missing[:3]}")
        state[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(cfg.num_experts)])
        state[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(cfg.num_experts)])
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    return state


def save_pretrained(
    model: Qwen3MoeForCausalLM,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write an HF model directory; shards above `max_shard_bytes` with a safetensors index."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
         "do_sample": False}, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in to_hf_tensors(model.state_dict(), cfg):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().clone().contiguous()  # own storage: safetensors refuses shared tensors
        size += nbytes
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata=meta)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata=meta)
            for name, t in shard.items():
                weight_map[name] = fname
                total += t.numel() * t.element_size()
        (out / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    if tokenizer_dir is not None:
        for fname in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / fname
            if src.is_file() and src.resolve() != (out / fname).resolve():
                shutil.copyfile(src, out / fname)
    return out


def weight_files(d: Path) -> list[str] | None:
    """The safetensors files of an HF directory: those its index names, or the single file; None if neither."""
    if (d / INDEX_FILE).is_file():
        return sorted(set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values()))
    return [SINGLE_FILE] if (d / SINGLE_FILE).is_file() else None


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every safetensors file in an HF directory, in index order."""
    d = Path(model_dir)
    files = weight_files(d)
    if files is None:
        raise FileNotFoundError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}; is this an HF model directory?")
    for fname in files:
        with safe_open(str(d / fname), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_config(model_dir: str | Path) -> ModelConfig:
    d = Path(model_dir)
    if not (d / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{d}: no {CONFIG_FILE}; is this an HF model directory?")
    return model_config_from_hf(json.loads((d / CONFIG_FILE).read_text()), name=d.name)


def load_pretrained(model_dir: str | Path, cfg: ModelConfig | None = None) -> Qwen3MoeForCausalLM:
    """Build our model from an HF directory (config.json + safetensors); strict about names and shapes."""
    cfg = cfg or load_config(model_dir)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    state = from_hf_tensors(iter_safetensors(model_dir), cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_local_shards(model_dir: str | Path, sharding) -> dict[str, torch.Tensor]:
    """One trainer rank's local tensors, read piece by piece from the HF directory's safetensors
    (only the slices this rank holds are read). `sharding` is a `rlhf.sharding.trainer.TrainerSharding`."""
    d = Path(model_dir)
    if (d / INDEX_FILE).is_file():
        where = json.loads((d / INDEX_FILE).read_text())["weight_map"]
    elif (d / SINGLE_FILE).is_file():
        where = None
    else:
        raise FileNotFoundError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}; is this an HF model directory?")
    by_file: dict[str, list] = {}
    for p in sharding.pieces:
        by_file.setdefault(where[p.param] if where else SINGLE_FILE, []).append(p)
    local: dict[str, torch.Tensor] = {}
    for fname, pieces in by_file.items():
        with safe_open(str(d / fname), framework="pt") as f:
            fill_buffers(pieces, sharding.local_shapes, lambda p: f.get_slice(p.param)[p.box.slices()], local)
    dtype = next(iter(local.values())).dtype if local else torch.float32
    for name, shape in sharding.local_shapes.items():  # a row shard with no rows (zero_stage=3, tiny dims)
        if name not in local and 0 in shape:
            local[name] = torch.empty(shape, dtype=dtype)
    missing = set(sharding.local_shapes) - set(local)
    if missing:
        raise ValueError(f"{d}: no tensors for {sorted(missing)[:3]}")
    return local


_NOT_SHAPE = {"name", "path"}


def check_model_dir(model: ModelConfig, make_tiny_args: str = "") -> Path:
    """The configured policy directory (`model.path`) exists and holds the configured shape: a readable
    config.json of that shape, safetensors files (headers only) that are whole and hold exactly the tensors
    that shape has, and a tokenizer whose vocabulary fits the model's. Each problem is one
    ConfigError naming the file and what to change (`make_tiny_args`: what the suggested `rlhf make-tiny`
    needs besides the directory, e.g. `--task code`)."""
    if model.path is None:
        raise ConfigError("model.path = None: set it to an HF model directory, e.g. the output of `rlhf make-tiny`")
    path = Path(model.path)
    where = f"model.path = {str(path)!r}"
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where}: no HF model directory there; "
                          f"create it with `rlhf make-tiny {path}{' ' + make_tiny_args if make_tiny_args else ''}` "
                          f"or point model.path at one")
    try:
        on_disk = load_config(path)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:  # bad JSON, missing or mistyped keys
        raise ConfigError(f"{where}: {path / CONFIG_FILE} cannot be read as a model config ({type(e).__name__}: "
                          f"{e}); rewrite it (rlhf make-tiny writes one) or point model.path elsewhere") from None
    clashes = [f"{f.name}: config {getattr(model, f.name)!r}, {path}/config.json {getattr(on_disk, f.name)!r}"
               for f in dataclasses.fields(on_disk)
               if f.name not in _NOT_SHAPE and getattr(on_disk, f.name) != getattr(model, f.name)]
    if clashes:
        raise ConfigError(f"{where} holds another shape than the model config; "
                          "fix the model YAML or the path:\n  " + "\n  ".join(clashes))
    check_weights(path, model)
    check_tokenizer(path, model.vocab_size)
    return path


def _checked_weight_files(d: Path) -> list[str]:
    """`weight_files`, each problem a ConfigError: no weights, an unreadable index, files it names missing."""
    where = f"model.path = {str(d)!r}"
    try:
        files = weight_files(d)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: {d / INDEX_FILE} is not a safetensors index ({type(e).__name__}: {e}); "
                          "rewrite it or remove it beside a single model.safetensors") from None
    if files is None:
        raise ConfigError(f"{where}: no {SINGLE_FILE} or {INDEX_FILE} beside config.json; copy the weights there "
                          "(safetensors only: no pickle checkpoints are read)")
    missing = [f for f in files if not (d / f).is_file()]
    if missing:
        raise ConfigError(f"{where}: {INDEX_FILE} names {missing[:3]} ({len(missing)} in all), which are not "
                          "there; copy the whole checkpoint")
    return files


def check_weights(d: Path, model: ModelConfig) -> None:
    """Every safetensors file whole (its header read, never its tensors) and their tensors exactly the
    model's: names and shapes as `rlhf.model.shapes.param_shapes` lists them."""
    from safetensors import SafetensorError

    from rlhf.model.shapes import param_shapes

    where = f"model.path = {str(d)!r}"
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for fname in _checked_weight_files(d):
        try:
            with safe_open(str(d / fname), framework="pt") as f:
                for name in f.keys():
                    found[name] = (tuple(f.get_slice(name).get_shape()), fname)
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{where}: {d / fname} is not a whole safetensors file ({e}); it may be truncated "
                              "or still being copied: copy it again") from None
    want = param_shapes(model)
    missing, unexpected = [n for n in want if n not in found], [n for n in found if n not in want]
    if missing or unexpected:
        raise ConfigError(f"{where}: the weights do not match model {model.name}: missing {missing[:3]} "
                          f"({len(missing)} in all), unexpected {unexpected[:3]} ({len(unexpected)} in all); "
                          "point model.path at a checkpoint of this model or fix the model YAML")
    wrong = [f"{n}: {found[n][0]} in {found[n][1]}, {tuple(s)} expected" for n, s in want.items()
             if found[n][0] != tuple(s)]
    if wrong:
        raise ConfigError(f"{where}: tensors of another shape than model {model.name} has: {wrong[:3]} "
                          f"({len(wrong)} in all); point model.path at a checkpoint of this model")


def check_tokenizer(d: Path, vocab_size: int) -> None:
    """A tokenizer.json that loads, whose ids all index the model's embedding."""
    from rlhf.data.tokenizer import load_tokenizer

    where = f"model.path = {str(d)!r}"
    if not (d / "tokenizer.json").is_file():
        raise ConfigError(f"{where}: no tokenizer.json; save the tokenizer beside the weights "
                          "(rlhf make-tiny writes one)")
    try:
        n = load_tokenizer(d).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the tokenizers library raises its own types for any malformed file
        raise ConfigError(f"{where}: {d / 'tokenizer.json'} does not load ({type(e).__name__}: {e}); "
                          "write it again") from None
    if n > vocab_size:
        raise ConfigError(f"{where}: the tokenizer has {n} tokens, more than the model's vocab_size {vocab_size}: "
                          "its highest ids would index past the embedding; use the model's own tokenizer")
