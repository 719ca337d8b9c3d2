"""Exact softmax attention through ``torch.nn.functional.scaled_dot_product_attention``.

Same (B, H, L, d) interface and padding convention as :func:`linear_attention`
(key_padding_mask True = padding).  Without padding the causal case uses ``is_causal``
(flash kernel on CPU and GPU); with padding an explicit boolean mask is built.  A query
whose every key is masked (a padded position under left padding) is allowed to see itself,
so no row of the softmax is empty and no NaN appears.  With fewer queries than keys (the last
L_q positions, decoding from a KV cache) causal query i sees keys up to L_k - L_q + i.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                           key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    L_q, L_k = q.shape[-2], k.shape[-2]
    if key_padding_mask is None and (not causal or L_q == L_k):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
    ones = torch.ones(L_q, L_k, dtype=torch.bool, device=q.device)
    allowed = ones.tril(L_k - L_q) if causal else ones
    if key_padding_mask is not None:  # query i is key L_k - L_q + i
        allowed = (allowed & ~key_padding_mask.bool()[:, None, None, :]) | ones.tril(L_k - L_q).triu(L_k - L_q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
