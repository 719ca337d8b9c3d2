"""Everything that defines the model, as one typed :class:`ModelConfig` (conf/model/*.yaml holds
the same keys; ``attention`` is an :class:`AttentionConfig`), checked before any work."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Mapping

from ..attention.feature_maps import KERNELS, NB_FEATURES
from ..attention.fla_backend import BACKENDS
from ..attention.linear import DEFAULT_CHUNK_SIZE
from ..errors import UserError
from ..tokenizer import VOCABULARIES, Tokenizer


#: the longest local window a model may have (model.attention.local_window): a local head's scores take
#: about 12 x length x min(window, length) bytes per layer, so a window this long is already one
#: exact attention over 16,384-residue proteins (3 GiB a head); longer windows are refused in one line
MAX_LOCAL_WINDOW = 16384

#: the version of a saved model config (checkpoints' ``hyper_parameters["model"]``, exports' config.json,
#: finetune.json's ``model``), written by :meth:`ModelConfig.to_dict`; :func:`migrate` reads older ones
CONFIG_VERSION = 3
#: the defaults that changed at each version: a saved config of an older version that leaves a key out
#: meant that version's default.  Version 1 (no ``config_version`` key: every file before it) had RoFormer's
#: rotary base and no local heads; version 2 takes conf/model/base.yaml's (issue 43: one truth for defaults);
#: version 3 has no dropout by default (issue 64, docs/speedrun.md), where earlier versions had 0.1
CHANGED_DEFAULTS = {2: {"rotary_base": 10000.0, "attention": {"local_heads": 0}}, 3: {"dropout": 0.1}}


@dataclass(frozen=True)
class AttentionConfig:
    kernel: str = "softmax"         # softmax (FAVOR+) | favor++ | relu | trig | elu | exact
    nb_features: int = NB_FEATURES  # random features (softmax, favor++, relu, trig)
    chunk_size: int = DEFAULT_CHUNK_SIZE  # causal linear attention: chunk length (one default: attention.linear)
    redraw_interval: int | None = 1000  # training forward calls between projection redraws (0/None: never)
    orthogonal: bool = True         # orthogonal (vs iid) random features
    relu_projection: bool = True    # the relu kernel with (True) or without a random projection
    run_seed: int = 0               # the run's seed, mixed into the projection draws (training sets it)
    backend: str = "auto"           # auto (CUDA: fla for causal when the stack allows, else parallel; CPU: torch) | torch | parallel | fla
    local_heads: int = 1            # the first this many heads: exact softmax in a sliding window (attention/local.py)
    local_window: int = 128         # their window: query i sees keys j with |i - j| < local_window


@dataclass(frozen=True)
class ModelConfig:
    """What defines a PerformerLM, with the key names and the defaults of conf/model/base.yaml
    (tests/test_model_config.py holds them equal)."""
    vocab_size: int = Tokenizer().vocab_size
    dim: int = 128
    depth: int = 4
    heads: int = 4
    ff_mult: int = 4
    dropout: float = 0.0            # none by default: docs/speedrun.md
    causal: bool = False
    position: str = "rotary"        # rotary (any length) | learned (up to max_positions)
    max_positions: int = 1024       # learned positions only: the longest input the model accepts
    rotary_base: float = 1000000.0  # rotary positions: theta_i = base^(-2i / head_dim); larger = slower rotations
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
        if self.attention.backend not in BACKENDS:
            raise UserError(f"model.attention.backend={self.attention.backend!r}: choose one of {', '.join(BACKENDS)}")
        if isinstance(self.rotary_base, bool) or not isinstance(self.rotary_base, (int, float)) or not self.rotary_base > 1:
            raise UserError(f"model.rotary_base must be a number above 1, got {self.rotary_base!r}")
        for key in ("vocab_size", "dim", "depth", "heads", "ff_mult", "max_positions"):
            _positive_int(f"model.{key}", getattr(self, key))
        _positive_int("model.attention.nb_features", self.attention.nb_features)
        _positive_int("model.attention.chunk_size", self.attention.chunk_size)
        _positive_int("model.attention.local_window", self.attention.local_window)
        if self.attention.local_window > MAX_LOCAL_WINDOW:
            raise UserError(f"model.attention.local_window={self.attention.local_window}: above the maximum "
                            f"{MAX_LOCAL_WINDOW}; a local head costs about 12 x length x min(window, length) bytes "
                            f"of scores per layer (a window of {MAX_LOCAL_WINDOW} on a {MAX_LOCAL_WINDOW}-residue "
                            f"protein: {12 * MAX_LOCAL_WINDOW ** 2 / 2 ** 30:.0f} GiB), and a window longer than "
                            f"the protein sees no more than the whole protein")
        if isinstance(self.attention.local_heads, bool) or not isinstance(self.attention.local_heads, int) \
                or not 0 <= self.attention.local_heads < self.heads:
            raise UserError(f"model.attention.local_heads must be an integer in [0, model.heads={self.heads}), "
                            f"got {self.attention.local_heads!r}")
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
        version = d.pop("config_version", CONFIG_VERSION)
        if version != CONFIG_VERSION:
            raise UserError(f"model.config_version={version!r}: a saved config of another version; read it "
                            f"with model.config.migrate (this code writes version {CONFIG_VERSION})")
        if "max_len" in d:
            d["max_positions"] = d.pop("max_len")
        return cls(**_known(cls, d, "model"))

    def to_dict(self) -> dict:
        """What defines the model (exports, output identities, checkpoints), every key written out with
        ``config_version``: attention.backend is left out, being how a process runs it, not what it computes."""
        d = asdict(self)
        d["attention"].pop("backend")
        return {**d, "config_version": CONFIG_VERSION}


def migrate(saved: Mapping, where: str = "model") -> dict:
    """A saved model config (a checkpoint's, an export's, a finetune output's) as this version reads it:
    the keys an older version left out get that version's defaults (:data:`CHANGED_DEFAULTS`), so a
    model saved before a default changed loads as it was trained.  A newer version is one line."""
    d = dict(saved)
    version = d.get("config_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= CONFIG_VERSION:
        raise UserError(f"{where}: config_version {version!r}: written by another protein-performer "
                        f"(this one reads versions 1 to {CONFIG_VERSION})")
    for v in range(version + 1, CONFIG_VERSION + 1):
        for key, old in CHANGED_DEFAULTS[v].items():
            if isinstance(old, dict):
                d[key] = {**old, **dict(d.get(key) or {})}
            else:
                d.setdefault(key, old)
    d["config_version"] = CONFIG_VERSION
    return d


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
