"""The Performer protein language model, top to bottom.

tokens -> embedding (+ learned positions, or rotary inside attention)      \
       -> depth x [pre-norm attention, pre-norm feed-forward], residual     } PerformerEncoder
       -> final norm -> hidden states (B, L, dim)                           /
       -> output head tied to the embedding -> logits                       PerformerLM

(the heads, that for the LM and those fine-tuning adds, are in :mod:`protein_performer.model.heads`).

Everything that defines the model is one typed :class:`ModelConfig` (conf/model/*.yaml
holds the same keys); which attention (FAVOR+ softmax, FAVOR++, ReLU, trig, elu+1 or exact
softmax) is its ``attention.kernel``, passed to :class:`protein_performer.attention.Attention`;
the model does not know or care. A causal model can also run as an RNN: ``init_state``
and ``step`` decode one token at a time with a constant-size state per layer.
"""
from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn as nn

from ..attention.masks import AttentionMasks
from ..errors import UserError
from .config import ModelConfig
from .heads import EsmLMHead, LMHead
from .layers import Block, token_dropout
from ..tokenizer import Tokenizer


def _token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Ids of any integer dtype (the tokenizer's uint8 included) as the int64 the embedding takes."""
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"token ids must be integers, got a {tokens.dtype} tensor")
    return tokens.long()


class PerformerEncoder(nn.Module):
    """Token ids -> hidden states: embedding (+ learned positions), the blocks, the final norm.
    What every head (:mod:`protein_performer.model.heads`) sits on."""

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
        masks = AttentionMasks(padding_mask, tokens.size(1))  # shared by the layers: one padding check, one band
        for block in self.blocks:
            x = block(x, masks)
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
