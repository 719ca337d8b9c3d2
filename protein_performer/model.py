"""The Performer protein language model, top to bottom.

tokens -> embedding (+ learned positions, or rotary inside attention)      \
       -> depth x [pre-norm attention, pre-norm feed-forward], residual     } PerformerEncoder
       -> final norm -> hidden states (B, L, dim)                           /
       -> output head tied to the embedding -> logits                       PerformerLM

(the heads, that for the LM and those fine-tuning adds, are in :mod:`protein_performer.heads`).

Everything that defines the model is one typed :class:`ModelConfig` (conf/model/*.yaml
holds the same keys); which attention (FAVOR+ softmax, FAVOR++, ReLU, trig, elu+1 or exact
softmax) is its ``attention.kernel``, passed to :class:`protein_performer.attention.Attention`;
the model does not know or care. A causal model can also run as an RNN: ``init_state``
and ``step`` decode one token at a time with a constant-size state per layer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import Attention
from .attention.feature_maps import KERNELS, NB_FEATURES
from .errors import UserError
from .heads import EsmLMHead, LMHead
from .tokenizer import VOCABULARIES, Tokenizer


@dataclass(frozen=True)
class AttentionConfig:
    kernel: str = "softmax"         # softmax (FAVOR+) | favor++ | relu | trig | elu | exact
    nb_features: int = NB_FEATURES  # random features (softmax, favor++, relu, trig)
    chunk_size: int = 128           # causal linear attention: prefix sums chunk by chunk
    redraw_interval: int | None = 1000  # training forward calls between projection redraws (0/None: never)
    orthogonal: bool = True         # orthogonal (vs iid) random features
    relu_projection: bool = True    # the relu kernel with (True) or without a random projection
    run_seed: int = 0               # the run's seed, mixed into the projection draws (training sets it)


@dataclass(frozen=True)
class ModelConfig:
    """What defines a PerformerLM, with the key names of conf/model/base.yaml."""
    vocab_size: int = Tokenizer().vocab_size
    dim: int = 128
    depth: int = 4
    heads: int = 4
    ff_mult: int = 4
    dropout: float = 0.1
    causal: bool = False
    position: str = "rotary"        # rotary (any length) | learned (up to max_positions)
    max_positions: int = 1024       # learned positions only: the longest input the model accepts
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    # --- what ESM-2 converted by convert-esm needs; the defaults are protein-performer's own models
    vocabulary: str = "protein-performer"  # protein-performer | esm (ESM's 33 tokens in ESM's id order)
    qkv_bias: bool = False          # biased q, k, v projections (the output projection always has a bias)
    norm_eps: float = 1e-5          # every LayerNorm's epsilon
    token_dropout: bool = False     # ESM-2's: <mask> embeddings zeroed, all scaled by 0.88 / (1 - masked fraction)
    lm_head: str = "tied"           # tied: h E^T + b | esm: dense, GELU, LayerNorm, then E^T + b
    rotary_inv_freq: str = "float64"  # rotary frequencies computed in float64 | float32 (as ESM computes them)

    def __post_init__(self):
        if isinstance(self.attention, Mapping):
            object.__setattr__(self, "attention", AttentionConfig(**_known(AttentionConfig, self.attention,
                                                                           "model.attention")))
        for key, allowed in (("vocabulary", VOCABULARIES), ("lm_head", ("tied", "esm")),
                             ("rotary_inv_freq", ("float64", "float32"))):
            if getattr(self, key) not in allowed:
                raise UserError(f"model.{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0:
            raise UserError(f"model.norm_eps must be a positive number, got {self.norm_eps!r}")
        if self.token_dropout and self.causal:
            raise UserError("model.token_dropout is ESM-2's masked-LM embedding scaling: not for a causal model")
        if self.position not in ("rotary", "learned"):
            raise UserError(f"model.position must be 'rotary' or 'learned', got {self.position!r}")
        if self.attention.kernel not in KERNELS:
            raise UserError(f"model.attention.kernel={self.attention.kernel!r}: choose one of {', '.join(KERNELS)}")
        for key in ("vocab_size", "dim", "depth", "heads", "ff_mult", "max_positions"):
            _positive_int(f"model.{key}", getattr(self, key))
        _positive_int("model.attention.nb_features", self.attention.nb_features)
        _positive_int("model.attention.chunk_size", self.attention.chunk_size)
        if self.attention.kernel == "trig" and self.attention.nb_features % 2:
            raise UserError(f"model.attention.nb_features={self.attention.nb_features}: the trig kernel "
                            f"needs an even number (sin and cos features)")
        if self.attention.redraw_interval:  # 0 / None: never redraw
            _positive_int("model.attention.redraw_interval", self.attention.redraw_interval)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise UserError(f"model.dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.dim % self.heads:
            raise UserError(f"model.dim={self.dim} is not divisible by model.heads={self.heads}")
        if (self.dim // self.heads) % 2 and self.position == "rotary":
            raise UserError(f"model.dim / model.heads = {self.dim // self.heads} is odd; rotary positions "
                            f"rotate pairs of features: use an even head size or model.position=learned")

    @classmethod
    def from_dict(cls, d: Mapping, **extra) -> "ModelConfig":
        """From a conf/model dict (``name`` ignored; ``max_len``, the old name of
        ``max_positions``, accepted): an unknown key is a one-line error naming it."""
        d = {k: v for k, v in {**d, **extra}.items() if k != "name"}
        if "max_len" in d:
            d["max_positions"] = d.pop("max_len")
        return cls(**_known(cls, d, "model"))

    def to_dict(self) -> dict:
        return asdict(self)


def _positive_int(key: str, value) -> None:
    """Checked before any work: ``model.depth=0`` would train a model without layers, exit 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{key} must be a positive integer, got {value!r}")


def _known(cls, d: Mapping, where: str) -> dict:
    names = [f.name for f in fields(cls)]
    for k in d:
        if k not in names:
            raise UserError(f"{where}.{k}: unknown key (known: {', '.join(names)})")
    return dict(d)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ff(norm(x))."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        super().__init__()
        c = config
        self.norm1 = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.attn = Attention(c.dim, c.heads, causal=c.causal, dropout=c.dropout, seed=seed,
                              rotary=c.position == "rotary", bias=c.qkv_bias, **asdict(c.attention))
        if c.rotary_inv_freq == "float32" and self.attn.rotary is not None:
            # ESM's frequencies differ from the float64 ones by an ulp: 1e-4 rad at position 2,000
            r = self.attn.rotary
            r.inv_freq = 1.0 / (10000 ** (torch.arange(0, r.dim, 2, dtype=torch.float32) / r.dim))
        self.norm2 = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.ff = FeedForward(c.dim, c.ff_mult * c.dim, c.dropout)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), padding_mask))
        return x + self.drop(self.ff(self.norm2(x)))

    def step(self, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        a, state = self.attn.step(self.norm1(x), state)
        x = x + a
        return x + self.ff(self.norm2(x)), state


def _token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Ids of any integer dtype (the tokenizer's uint8 included) as the int64 the embedding takes."""
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"token ids must be integers, got a {tokens.dtype} tensor")
    return tokens.long()


def token_dropout(x: torch.Tensor, tokens: torch.Tensor, padding_mask: torch.Tensor | None,
                  mask_id: int) -> torch.Tensor:
    """ESM-2's token dropout, as fair-esm and transformers compute it: ESM-2 was trained with the
    embeddings of <mask> (12 % of the tokens, 15 % x 80 %) zeroed, so <mask> embeddings are zeroed
    and all are scaled by (1 - 0.12) / (1 - the fraction of <mask> among the protein's tokens)."""
    masked = tokens == mask_id
    lengths = tokens.shape[1] if padding_mask is None else (~padding_mask.bool()).sum(-1)
    observed = masked.sum(-1).float() / lengths
    x = x.masked_fill(masked.unsqueeze(-1), 0.0)
    return (x * (1 - 0.15 * 0.8) / (1 - observed)[:, None, None]).to(x.dtype)


class PerformerEncoder(nn.Module):
    """Token ids -> hidden states: embedding (+ learned positions), the blocks, the final norm.
    What every head (:mod:`protein_performer.heads`) sits on."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = c = config
        self.causal, self.position, self.max_positions = c.causal, c.position, c.max_positions
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.pos_embed = nn.Embedding(c.max_positions, c.dim) if c.position == "learned" else None
        self.drop = nn.Dropout(c.dropout)
        # each layer draws its own random-feature projections (seed = layer index)
        self.blocks = nn.ModuleList(Block(c, seed=i) for i in range(c.depth))
        self.norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.mask_id = Tokenizer(vocabulary=c.vocabulary).mask_id if c.token_dropout else None
        nn.init.normal_(self.embed.weight, std=0.02)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed.weight, std=0.02)

    @property
    def depth(self) -> int:
        return len(self.blocks)

    def _positions(self, x: torch.Tensor, start: int, length: int) -> torch.Tensor:
        if self.pos_embed is None:
            return x
        if start + length > self.max_positions:
            raise UserError(f"sequence of {start + length} tokens exceeds the learned positions "
                            f"(model.max_positions={self.max_positions}); use model.position=rotary for longer proteins")
        return x + self.pos_embed(torch.arange(start, start + length, device=x.device))

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None,
                return_layers: bool = False):
        """tokens (B, L), any integer dtype -> hidden states (B, L, dim) after the final norm.
        ``padding_mask`` is True at padding. With ``return_layers``, also the list
        [embedding, block 1, ..., block depth-1, final norm]."""
        tokens = _token_ids(tokens)
        x = self.embed(tokens)
        if self.mask_id is not None:
            x = token_dropout(x, tokens, padding_mask, self.mask_id)
        x = self.drop(self._positions(x, 0, tokens.size(1)))
        layers = [x]
        for block in self.blocks:
            x = block(x, padding_mask)
            layers.append(x)
        h = self.norm(x)
        if return_layers:
            layers[-1] = h
            return h, layers
        return h

    # --- RNN-mode decoding (causal models) -------------------------------------------
    def init_state(self, batch_size: int, device=None) -> dict:
        if not self.causal:
            raise UserError("RNN-mode decoding needs a causal model (objective=clm)")
        return {"pos": 0, "layers": [b.attn.init_state(batch_size, device) for b in self.blocks]}

    @torch.no_grad()
    def step(self, token: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """One token per sequence (B,), or T tokens (B, T) in one chunked call (a prompt) -> the
        hidden states (B, dim) or (B, T, dim) and the new state; cost and memory per token do not
        grow with position for linear kernels."""
        T = token.shape[1] if token.dim() == 2 else 1
        x = self._positions(self.embed(_token_ids(token)), state["pos"], T)
        new_layers = []
        for block, s in zip(self.blocks, state["layers"]):
            x, s = block.step(x, s)
            new_layers.append(s)
        return self.norm(x), {"pos": state["pos"] + T, "layers": new_layers}


class PerformerLM(nn.Module):
    """:class:`PerformerEncoder` with a language-model head tied to its embedding.

    ``PerformerLM(ModelConfig(...))``, or keyword overrides of the defaults
    (``PerformerLM(dim=64, causal=True, attention={"kernel": "relu"})``). ``position``
    is "rotary" (default; any length) or "learned" (up to ``max_positions``).

    Its state_dict keys are those of the single class it used to be (``embed.weight``,
    ``blocks.0...``, ``head_bias``: checkpoints and exported directories hold them), mapped
    to and from ``encoder.*`` / ``lm_head.bias`` by the hooks below.
    """

    def __init__(self, config: ModelConfig | None = None, **overrides):
        super().__init__()
        if overrides:
            base = ModelConfig() if config is None else config
            config = ModelConfig.from_dict({**asdict(base), **overrides})
        self.config = c = config or ModelConfig()
        self.causal, self.position, self.max_positions = c.causal, c.position, c.max_positions
        # the head first: its bias stays the first parameter, as in older checkpoints' optimizer state
        self.lm_head = LMHead(c.vocab_size) if c.lm_head == "tied" else EsmLMHead(c.dim, c.vocab_size, c.norm_eps)
        self.encoder = PerformerEncoder(c)
        self.register_state_dict_post_hook(_saved_keys)
        self.register_load_state_dict_pre_hook(_loaded_keys)
        self.register_load_state_dict_post_hook(_reported_keys)

    # the encoder's parts, under the names callers have always used
    embed = property(lambda self: self.encoder.embed)
    pos_embed = property(lambda self: self.encoder.pos_embed)
    blocks = property(lambda self: self.encoder.blocks)
    norm = property(lambda self: self.encoder.norm)
    head_bias = property(lambda self: self.lm_head.bias)

    @property
    def depth(self) -> int:
        return self.encoder.depth

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, self.encoder.embed.weight)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None,
                return_layers: bool = False):
        """tokens (B, L), any integer dtype -> logits (B, L, V). ``padding_mask`` is True at padding.
        With ``return_layers``, also the hidden states: [embedding, block 1, ..., final norm]."""
        if return_layers:
            h, layers = self.encoder(tokens, padding_mask, return_layers=True)
            return self.logits(h), layers
        return self.logits(self.encoder(tokens, padding_mask))

    def init_state(self, batch_size: int, device=None) -> dict:
        return self.encoder.init_state(batch_size, device)

    @torch.no_grad()
    def step(self, token: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """Tokens (B,) or (B, T) -> next-token logits (B, V) or (B, T, V) and the new state."""
        h, state = self.encoder.step(token, state)
        return self.logits(h), state


def _saved_name(name: str) -> str:
    return "head_bias" if name == "lm_head.bias" else name.removeprefix("encoder.")


def _saved_keys(module: PerformerLM, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: ``encoder.X`` -> ``X``, ``lm_head.bias`` -> ``head_bias`` (order kept)."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + _saved_name(key[len(prefix):])] = state_dict.pop(key)


def _loaded_keys(module: PerformerLM, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook, the inverse: ``head_bias`` -> ``lm_head.bias``, an encoder part's
    ``X`` -> ``encoder.X``; any other key is left as it is (reported unexpected if strict)."""
    module.__dict__["_loading_prefix"] = prefix  # for _reported_keys
    parts = set(module.encoder._modules) | set(module.encoder._parameters) | set(module.encoder._buffers)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name = key[len(prefix):]
        if name == "head_bias":
            state_dict[prefix + "lm_head.bias"] = state_dict.pop(key)
        elif name.split(".", 1)[0] in parts:
            state_dict[prefix + "encoder." + name] = state_dict.pop(key)


def _reported_keys(module: PerformerLM, incompatible) -> None:
    """load_state_dict post-hook: missing and unexpected keys named as the state_dict names them."""
    prefix = module.__dict__.pop("_loading_prefix", "")
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [prefix + _saved_name(k[len(prefix):]) if k.startswith(prefix) else k for k in keys]
