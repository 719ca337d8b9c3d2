"""Attention for protein-performer: feature maps, linear attention, exact attention, the layer.

Public API:
    linear_attention(q, k, v, causal=False, key_padding_mask=None, chunk_size=None) -> out
    chunk_linear_attention / bidirectional_linear_attention / recurrent_linear_attention
        (q, k, v, ..., initial_state=None, output_final_state=False) -> (out, final_state)
    init_linear_state(B, H, r, d)                  empty (S, Z, m) state
    CausalLinearAttention                          chunked causal attention with its own backward
    softmax_attention_sdpa(q, k, v, causal, key_padding_mask)
    Attention(dim, heads, kernel="softmax", ...)   the module the model uses
    kernel_attention(feature_map, q, k, v, ...)    raw q, k -> features -> attention
    fused_favor.fused_favor_attention              FAVOR+ / FAVOR++ fused with the feature maps (both modes)
    FavorPlus, FavorPlusPlus, TrigFeatures, ReluFeatures, EluFeatures, HedgehogFeatures,
    build_feature_map, distill (fit a learnable map to exact attention)
    naive.*                                        quadratic references (tests only)
"""
from .feature_maps import (KERNELS, EluFeatures, FavorPlus, FavorPlusPlus, FeatureMap, HedgehogFeatures, KeyFeatures,
                           ReluFeatures, TrigFeatures, build_feature_map, distill, gaussian_random_matrix, oprf_A, oprf_rho)
from .layer import Attention, kernel_attention, projection_seed
from .linear import (CausalLinearAttention, bidirectional_linear_attention, chunk_linear_attention,
                     init_linear_state, linear_attention, recurrent_linear_attention)
from .rotary import RotaryEmbedding
from .softmax import softmax_attention_sdpa

__all__ = [
    "Attention", "linear_attention", "chunk_linear_attention", "bidirectional_linear_attention",
    "recurrent_linear_attention", "init_linear_state",
    "CausalLinearAttention", "KeyFeatures", "softmax_attention_sdpa", "RotaryEmbedding", "KERNELS", "FeatureMap",
    "FavorPlus", "FavorPlusPlus", "TrigFeatures", "ReluFeatures", "EluFeatures", "HedgehogFeatures", "build_feature_map",
    "distill", "gaussian_random_matrix", "oprf_A", "oprf_rho", "projection_seed", "kernel_attention",
]
