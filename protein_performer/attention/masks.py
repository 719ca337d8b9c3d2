"""What the layers of one forward pass share about the input: its padding and the local heads' band.

Why: each layer used to decide for itself whether the padding mask held any padding (a host sync per
layer; now nobody inside the model looks: None means no padding) and to build the local heads' band mask (a dozen small ops per layer).  Both depend on the
input only, so the encoder builds one :class:`AttentionMasks` per forward and hands it to every
layer; a layer called on its own wraps a plain mask in one.
"""
from __future__ import annotations

import torch

from .local import local_band, local_bias


class AttentionMasks:
    """The key padding mask (B, L) bool, True = padding, or None when nothing is padded (the caller's
    word: a mask of all False is applied, not looked into), and the local heads' additive band mask per (window, causal, heads, dtype), built on first use and kept."""

    def __init__(self, key_padding_mask: torch.Tensor | None, length: int):
        if key_padding_mask is not None:  # taken as given: whether it pads anything is the data path's call
            key_padding_mask = key_padding_mask.bool()  # (a check here would be a host sync in every step)
        self.key_padding_mask, self.length = key_padding_mask, int(length)
        self._bands: dict = {}

    @classmethod
    def of(cls, mask, length: int) -> "AttentionMasks":
        """``mask`` as AttentionMasks: kept when it is one already, else wrapped."""
        return mask if isinstance(mask, AttentionMasks) else cls(mask, length)

    def local_bias(self, window: int, causal: bool, heads: int, dtype: torch.dtype, device) -> torch.Tensor:
        """local.local_attention's additive mask for this input (local.local_bias), built once per
        (window, causal, heads, dtype, device)."""
        key = (int(window), bool(causal), int(heads), dtype, str(device))
        if key not in self._bands:
            band = local_band(self.length, window, causal, self.key_padding_mask, device)
            self._bands[key] = local_bias(band, heads, dtype)
        return self._bands[key]
