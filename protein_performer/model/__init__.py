"""The model: its config, its layers, the encoder and the language model over it, the heads.

``from protein_performer.model import ModelConfig, PerformerEncoder, PerformerLM`` is the public
entry; the modules hold one concept each (config, layers, encoder, heads)."""
from .config import AttentionConfig, ModelConfig
from .encoder import PerformerEncoder, PerformerLM

__all__ = ["AttentionConfig", "ModelConfig", "PerformerEncoder", "PerformerLM"]
