"""``convert-esm``: an ESM-2 model -> an exported protein-performer directory (``pretrained.py``).

Input: a transformers ``EsmForMaskedLM`` directory (``save_pretrained`` or the hub cache: config.json
and model.safetensors or pytorch_model.bin) or a fair-esm ``.pt`` checkpoint ({"model": state dict,
"cfg": {"model": settings}}). Neither is unpickled beyond ``weights_only`` (fair-esm's settings are an
``argparse.Namespace``, the one class allowed). The architecture maps one to one: ESM's 33-token
vocabulary (``model.vocabulary=esm``), token dropout, rotary positions (float32 frequencies, as ESM
computes them), pre-LayerNorm blocks with biased q/k/v/output projections, GELU feed-forward, the
final LayerNorm and ESM's LM head (dense, GELU, LayerNorm, tied decoder + bias). With
``model.attention.kernel=exact`` the converted model computes ESM-2's logits and hidden states;
a linear kernel swaps the attention under the same weights (recover with a fine-tune).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from .errors import UserError, one_line
from .output_guard import OutputGuard
from .model import AttentionConfig, ModelConfig, PerformerLM
from .hub.export import export_config, write_model_dir
from .tokenizer import ESM_TOKENS

#: ESM-2's names (after the prefixes below) -> this project's; {i} a layer
HF_NAMES = {"embeddings.word_embeddings.weight": "embed.weight",
            "encoder.emb_layer_norm_after.{p}": "norm.{p}",
            "encoder.layer.{i}.attention.LayerNorm.{p}": "blocks.{i}.norm1.{p}",
            "encoder.layer.{i}.attention.self.{q}.{p}": "qkv",
            "encoder.layer.{i}.attention.output.dense.{p}": "blocks.{i}.attn.to_out.{p}",
            "encoder.layer.{i}.LayerNorm.{p}": "blocks.{i}.norm2.{p}",
            "encoder.layer.{i}.intermediate.dense.{p}": "blocks.{i}.ff.fc1.{p}",
            "encoder.layer.{i}.output.dense.{p}": "blocks.{i}.ff.fc2.{p}",
            "lm_head.dense.{p}": "lm_head.dense.{p}", "lm_head.layer_norm.{p}": "lm_head.norm.{p}",
            "lm_head.bias": "head_bias", "lm_head.decoder.weight": "tied"}
FAIR_NAMES = {"embed_tokens.weight": "embed.weight", "emb_layer_norm_after.{p}": "norm.{p}",
              "layers.{i}.self_attn_layer_norm.{p}": "blocks.{i}.norm1.{p}",
              "layers.{i}.self_attn.{q}_proj.{p}": "qkv",
              "layers.{i}.self_attn.out_proj.{p}": "blocks.{i}.attn.to_out.{p}",
              "layers.{i}.final_layer_norm.{p}": "blocks.{i}.norm2.{p}",
              "layers.{i}.fc1.{p}": "blocks.{i}.ff.fc1.{p}", "layers.{i}.fc2.{p}": "blocks.{i}.ff.fc2.{p}",
              "lm_head.dense.{p}": "lm_head.dense.{p}", "lm_head.layer_norm.{p}": "lm_head.norm.{p}",
              "lm_head.bias": "head_bias", "lm_head.weight": "tied"}
#: left out: contact prediction (a regression on attention maps, not part of the LM) and the
#: rotary frequencies (recomputed, checked equal)
IGNORED = re.compile(r"(^|\.)contact_head\.|(^|\.)pooler\.|inv_freq$|position_ids$")
LICENCE = ("MIT (ESM-2's code and weights, https://github.com/facebookresearch/esm/blob/main/LICENSE; "
           "cite: Lin et al. 2023, Evolutionary-scale prediction of atomic-level protein structure with a "
           "language model, Science)")


def _pattern(template: str) -> re.Pattern:
    regex = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias|gamma|beta)")
    return re.compile("^" + regex.replace(r"\{q\}", r"(?P<q>query|key|value|q|k|v)") + "$")


def map_state(state: dict, names: dict, depth: int, where: str) -> dict[str, torch.Tensor]:
    """ESM's tensors -> PerformerLM's state_dict names; q, k, v concatenated into ``to_qkv``; the
    tied decoder checked equal to the embedding. A tensor that fits no name is a one-line error."""
    patterns = [(_pattern(t), target) for t, target in names.items()]
    out, qkv, tied = {}, {}, None
    for name, t in state.items():
        if IGNORED.search(name):
            continue
        for regex, target in patterns:
            m = regex.match(name)
            if m:
                break
        else:
            raise UserError(f"{where}: unexpected tensor {name} (not an ESM-2 masked LM this converter maps)")
        g = m.groupdict()
        if g.get("p") in ("gamma", "beta"):  # LayerNorm's old names (transformers saves ESM's so)
            g["p"] = {"gamma": "weight", "beta": "bias"}[g["p"]]
        if target == "qkv":
            qkv[(int(g["i"]), g["p"], g["q"][0])] = t
        elif target == "tied":
            tied = t
        else:
            out[target.format(**g)] = t
    for i in range(depth):
        for p in ("weight", "bias"):
            parts = [qkv.get((i, p, c)) for c in "qkv"]
            if any(x is None for x in parts):
                raise UserError(f"{where}: layer {i} lacks its query/key/value {p} (ESM-2 has biased projections)")
            out[f"blocks.{i}.attn.to_qkv.{p}"] = torch.cat(parts)
    if tied is not None and "embed.weight" in out and not torch.equal(tied, out["embed.weight"]):
        raise UserError(f"{where}: the LM decoder is not tied to the embedding (ESM-2's is); not convertible")
    return out


# --- reading ----------------------------------------------------------------------------------
def read_transformers(d: Path) -> tuple[dict, dict, dict]:
    """An EsmForMaskedLM directory -> (ModelConfig keys, mapped tensors, source description)."""
    try:
        config = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{d / 'config.json'}: not valid JSON ({one_line(e)})") from e
    where = d / "config.json"
    if not isinstance(config, dict) or config.get("model_type") != "esm":
        raise UserError(f"{where}: model_type is {config.get('model_type') if isinstance(config, dict) else None!r}, "
                        f"not 'esm' (a transformers ESM directory)")
    for key, want in (("position_embedding_type", "rotary"), ("emb_layer_norm_before", False),
                      ("is_folding_model", False), ("hidden_act", "gelu"), ("vocab_size", len(ESM_TOKENS))):
        if config.get(key) not in (None, want):  # None: transformers' default, ESM-2's
            raise UserError(f"{where}: {key} is {config.get(key)!r}; ESM-2 (what convert-esm maps) has {want!r}")
    vocab = d / "vocab.txt"
    if vocab.is_file() and vocab.read_text(encoding="utf-8").split() != list(ESM_TOKENS):
        raise UserError(f"{vocab}: not ESM-2's 33-token vocabulary")
    dim, heads, inter, depth = (_size(where, config, key) for key in ("hidden_size", "num_attention_heads",
                                                                      "intermediate_size", "num_hidden_layers"))
    if inter % dim:
        raise UserError(f"{where}: intermediate_size {inter} is not a multiple of hidden_size {dim}")
    settings = {"dim": dim, "depth": depth, "heads": heads, "ff_mult": inter // dim,
                "norm_eps": float(config.get("layer_norm_eps", 1e-12)),
                "token_dropout": bool(config.get("token_dropout", False)),
                "dropout": float(config.get("hidden_dropout_prob", 0.0))}
    weights = d / "model.safetensors"
    if weights.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            state = load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{weights}: not a readable safetensors file ({one_line(e)})") from e
    elif (d / "pytorch_model.bin").is_file():
        weights = d / "pytorch_model.bin"
        state = _torch_load(weights)
    else:
        raise UserError(f"{d}: no model.safetensors or pytorch_model.bin")
    state = {re.sub(r"^esm\.", "", k): v for k, v in state.items()}
    name = config.get("_name_or_path") or d.name
    return settings, map_state(state, HF_NAMES, settings["depth"], str(weights)), {
        "format": "transformers EsmForMaskedLM", "name": str(name), "path": str(d)}


def read_fair_esm(path: Path) -> tuple[dict, dict, dict]:
    """A fair-esm ESM-2 checkpoint -> (ModelConfig keys, mapped tensors, source description)."""
    data = _torch_load(path)
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise UserError(f"{path}: not a fair-esm checkpoint (a dict with 'model' and 'cfg')")
    cfg = (data.get("cfg") or {}).get("model") if isinstance(data.get("cfg"), dict) else None
    if cfg is None:
        arch = getattr(data.get("args"), "arch", None)
        raise UserError(f"{path}: no cfg['model']: an ESM-1 checkpoint ({arch or 'args'}); convert-esm maps ESM-2")
    get = (lambda k: cfg.get(k)) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
    missing = [k for k in ("encoder_layers", "encoder_embed_dim", "encoder_attention_heads") if get(k) is None]
    if missing:
        raise UserError(f"{path}: cfg['model'] lacks {', '.join(missing)}")
    state = {re.sub(r"^(encoder\.sentence_encoder\.|encoder\.)", "", k): v for k, v in data["model"].items()}
    where = f"{path}: cfg['model']"
    dim, depth, heads = (_size(where, get, key) for key in ("encoder_embed_dim", "encoder_layers",
                                                            "encoder_attention_heads"))
    settings = {"dim": dim, "depth": depth, "heads": heads,
                "ff_mult": 4, "norm_eps": 1e-5, "token_dropout": bool(get("token_dropout")), "dropout": 0.0}
    return settings, map_state(state, FAIR_NAMES, settings["depth"], str(path)), {
        "format": "fair-esm checkpoint", "name": path.stem, "path": str(path)}


def _size(where, config, key: str) -> int:
    """A size from an ESM config (``config``: a dict, or a getter), checked to be a positive integer:
    one line naming it, not a traceback or a model of another size (``encoder_layers: 2.5``)."""
    value = config(key) if callable(config) else config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{where}: {key} is {value!r}, not a positive integer")
    return value


def _torch_load(path: Path):
    """torch.load with weights_only=True; fair-esm's settings need argparse.Namespace, nothing else."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable or unsafe file is the user's error
        raise UserError(f"{path}: not a readable ESM checkpoint (torch.load, weights only: {type(e).__name__} {one_line(e)})") from e


def read_esm(path) -> tuple[dict, dict, dict]:
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(f"input {p}: a directory without config.json (expected a transformers ESM directory)")
        return read_transformers(p)
    if not p.is_file():
        raise UserError(f"input {p}: no such file or directory")
    return read_fair_esm(p)


# --- converting -------------------------------------------------------------------------------
def build(settings: dict, tensors: dict, attention: dict | None, where: str) -> PerformerLM:
    """The PerformerLM of ESM's settings with ``attention`` (default exact), ESM's tensors loaded;
    every parameter must come from ESM (the attention's own buffers come from the kernel)."""
    att = {"kernel": "exact", "local_heads": 0, **(attention or {})}  # ESM-2's heads all see the whole protein
    config = ModelConfig(vocab_size=len(ESM_TOKENS), vocabulary="esm", qkv_bias=True, lm_head="esm",
                         rotary_inv_freq="float32", position="rotary", rotary_base=10000.0,  # ESM-2's
                         attention=AttentionConfig(**_known_attention(att)), **settings)
    with torch.device("meta"):  # shapes only: a small file whose config claims a huge model allocates nothing
        model = PerformerLM(config)
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    params = {n for n, _ in model.named_parameters()}
    saved = {"lm_head.bias": "head_bias"}
    params = {saved.get(n, n.removeprefix("encoder.")) for n in params}
    missing = sorted(params - set(tensors))
    if missing:
        raise UserError(f"{where}: lacks {', '.join(missing[:3])} (not a complete ESM-2 masked LM)")
    for k, t in tensors.items():
        if k not in expected or t.shape != expected[k].shape:
            raise UserError(f"{where}: {k} has shape {tuple(t.shape)}, the model its config describes needs "
                            f"{tuple(expected[k].shape) if k in expected else 'none'}")
    model = PerformerLM(config)  # the tensors fit: now the real one
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    model.load_state_dict({**expected, **{k: t.float() for k, t in tensors.items()}}, strict=False)
    return model.eval()


def _known_attention(att: dict) -> dict:
    from .model.config import _known
    return _known(AttentionConfig, att, "model.attention")


def convert(input, output, overwrite: bool = False, attention: dict | None = None) -> Path:
    """Convert ESM-2 ``input`` into the exported directory ``output`` (written beside it, loaded back
    and checked to reproduce the converted model's logits, then renamed into place; the same
    overwrite rules, lock and journal as ``export``)."""
    out, src = Path(output), Path(input)
    OutputGuard("convert-esm", {"input": src}).folder_path("output", out, holds=False)  # the output guard
    settings, tensors, source = read_esm(src)
    model = build(settings, tensors, attention, str(src))
    config = export_config(model.config, {"objective": "mlm"}, None)
    config["converted_from"] = source
    return write_model_dir(out, model, config, converted_card(config, model, source), overwrite=overwrite)


def converted_card(config: dict, model: PerformerLM, source: dict) -> str:
    att = config["attention"]
    n = sum(p.numel() for p in model.parameters())
    exact = att["kernel"] == "exact"
    return "\n".join([
        "---", "library_name: transformers", "pipeline_tag: fill-mask", "license: mit",
        "tags: [protein, protein-language-model, esm, esm2, protein-performer]", "---", "",
        f"# {source['name']} converted by protein-performer: {att['kernel']} attention", "",
        f"ESM-2 ({source['format']} `{source['name']}`, {n:,} parameters; dim {config['dim']}, depth "
        f"{config['depth']}, heads {config['heads']}) in protein-performer's exported format, converted by "
        "`protein-performer convert-esm`. Vocabulary, token ids and logits are ESM's (33 tokens, `vocab.txt`); "
        "a protein is `<cls> residues <eos>`.", "",
        ("Attention is exact softmax: the model computes ESM-2's logits and hidden states (tested to 1e-5)."
         if exact else
         f"Attention is `{att['kernel']}` in place of ESM-2's softmax, with ESM-2's weights unchanged: "
         "outputs differ from ESM-2's until a short fine-tune recovers them (not done here)."), "",
        "The contact-prediction head of ESM-2 is not carried over.", "",
        "## Licence", "", f"- weights: {LICENCE}.", "- code (`*.py` here and protein-performer): MIT.", ""])
