"""transformers model code of an exported protein-performer model (copied by its export).

Self-contained on purpose: a colleague needs torch and transformers, not protein-performer.
It is a second, inference-first implementation of protein-performer's ``PerformerEncoder``
and ``PerformerLM`` forward passes, written for reading rather than speed:

    tokens -> embedding (+ learned positions, or rotary on q and k)
           -> depth x [x + attention(norm(x)), x + feed-forward(norm(x))]
           -> final norm -> hidden states         ProteinPerformerModel (AutoModel)
           -> logits against the embedding matrix (tied) + bias
                                                  ProteinPerformerFor{MaskedLM,CausalLM}
           -> a fine-tuned head (an export of protein-performer finetune): pooled over the
              residues -> linear                  ProteinPerformerForSequenceClassification
              at every position -> linear         ProteinPerformerForTokenClassification

Attention is exact softmax (SDPA) or linear attention phi(q) (phi(K)^T [V, 1]) through the
kernel's feature map phi ("softmax" = FAVOR+, "favor++", "relu", "trig", "elu", "hedgehog"). The random
projections and FAVOR++'s rho are buffers loaded from model.safetensors; nothing is
redrawn or updated here (no training-time redraws), so the model computes what the exported
one computed. The causal path walks the sequence chunk by chunk carrying the state
(S, Z) of keys seen so far, so memory stays linear in the length. Exponential features
(FAVOR+, FAVOR++) hand each key over as phi(k) exp(s) with max phi(k) = 1; a query sees key
j with weight exp(s_j - M), M the largest s it can see, so nothing overflows.

With ``attention.local_heads`` = n, the first n heads attend exactly (softmax) to the keys within
``local_window`` positions (|i - j| < window; causal: 0 <= i - j < window), block by block so memory
stays linear too; the other heads through the kernel.

Logits match protein-performer's to float32 round-off (the export's tests check 1e-5).
There is no KV cache and no ``generate()``: sample with protein-performer's RNN-mode
``scripts/generate.py``.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import (BaseModelOutput, CausalLMOutput, MaskedLMOutput, SequenceClassifierOutput,
                                           TokenClassifierOutput)

from .configuration_protein_performer import ProteinPerformerConfig

LINEAR_KERNELS = ("softmax", "favor++", "relu", "trig", "elu", "hedgehog")  # = protein-performer's registry (tested)
RELU_EPS = 1e-3         # added to ReLU features
TRIG_FLOOR = 1e-6       # trig normalizer floor, relative to its bound
TRIG_MAX_LOG_SCALE = 40.0
ROTARY_BASE = 10000.0


def rotate(x, base=ROTARY_BASE, float32_freqs=False):
    """Rotary position embedding ("rotate half" layout) of x (B, H, L, d), positions 0..L-1; the
    frequencies computed in float64, or in float32 as ESM computes them (``rotary_inv_freq``)."""
    d = x.shape[-1]
    dtype = torch.float32 if float32_freqs else torch.float64
    inv_freq = (1.0 / (base ** (torch.arange(0, d, 2, dtype=dtype) / d))).float().to(x.device)
    freqs = torch.outer(torch.arange(x.shape[-2], device=x.device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * emb.cos().to(x.dtype) + torch.cat((-x2, x1), dim=-1) * emb.sin().to(x.dtype)


def oprf_A(rho):
    """FAVOR++'s variance-optimal A for rho (Likhosherstov et al. 2022)."""
    rho = rho.clamp_min(0)
    return (1 - 2 * rho - torch.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16


class FeatureMap(nn.Module):
    """phi for one linear kernel, with its buffers (random projection; FAVOR++'s per-head rho)."""

    def __init__(self, kernel, head_dim, heads, nb_features, relu_projection):
        super().__init__()
        self.kernel, self.head_dim = kernel, head_dim
        self.relu_projection = relu_projection
        rows = {"softmax": nb_features, "favor++": nb_features, "trig": nb_features // 2,
                "relu": nb_features if relu_projection else 0}.get(kernel)
        if rows is not None:
            self.register_buffer("projection", torch.zeros(rows, head_dim))
        if kernel == "favor++":
            self.register_buffer("rho", torch.zeros(heads))
            self.register_buffer("rho_updates", torch.zeros((), dtype=torch.long))
        if kernel == "hedgehog":  # learned per-head map, loaded from model.safetensors
            self.weight = nn.Parameter(torch.zeros(heads, head_dim, nb_features // 2))
            self.bias = nn.Parameter(torch.zeros(heads, 1, nb_features // 2))

    def forward(self, x, is_query):
        """Raw (rotated) q or k (B, H, L, d), float32 -> (features (B, H, L, r), log-scale (B, H, L, 1) or None)."""
        d = self.head_dim
        if self.kernel == "elu":
            return F.elu(x) + 1, None
        if self.kernel == "hedgehog":  # [softmax(W x + b), softmax(-W x - b)] per head
            u = x @ self.weight.to(x.dtype) + self.bias.to(x.dtype)
            return torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)], dim=-1), None
        if self.kernel == "relu":
            u = x @ (self.projection.to(x.dtype) * d ** -0.25).T if self.relu_projection else x * d ** -0.25
            return u.clamp_min(0) + RELU_EPS, None
        if self.kernel == "trig":
            x = x * d ** -0.25
            p = x @ self.projection.to(x.dtype).T
            f = torch.cat([torch.sin(p), torch.cos(p)], dim=-1)
            if is_query:
                return f, None
            return f * torch.exp((0.5 * (x * x).sum(-1, keepdim=True)).clamp_max(TRIG_MAX_LOG_SCALE)), None
        # FAVOR+ is FAVOR++ with A = 0: exp(B w.x + A |w|^2 - |x|^2/2) with x = q d^(-1/4)
        w = self.projection.to(x.dtype)
        if self.kernel == "favor++":
            A = oprf_A(self.rho.to(x.dtype)).view(-1, 1, 1)                  # (H, 1, 1)
            u = x @ ((torch.sqrt(1 - 4 * A) * d ** -0.25) * w).transpose(-1, -2) + A * (w * w).sum(-1)
        else:
            u = x @ (w * d ** -0.25).T
        if is_query:  # a per-query factor cancels: shift by the row maximum
            return torch.exp(u - u.amax(-1, keepdim=True)), None
        u = u - (0.5 * d ** -0.5) * (x * x).sum(-1, keepdim=True)
        s = u.amax(-1, keepdim=True)
        return torch.exp(u - s), s

    def normalizer_floor(self, k, causal, pad):
        """Trig only: the normalizer's lower clamp, TRIG_FLOOR times its bound over the visible keys."""
        k = k * self.head_dim ** -0.25
        scale = torch.exp((0.5 * (k * k).sum(-1, keepdim=True)).clamp_max(TRIG_MAX_LOG_SCALE))
        if pad is not None:
            scale = scale.masked_fill(pad[:, None, :, None], 0.0)
        total = scale.cumsum(-2) if causal else scale.sum(-2, keepdim=True)
        return (TRIG_FLOOR * self.projection.shape[0]) * total.clamp_min(torch.finfo(k.dtype).tiny)


def linear_attention(q, k, v, s, causal, chunk_size):
    """Unnormalized sums [num, den] = sum_j exp(s_j - M_i) (q_i.k_j) [v_j, 1] over the visible keys j.

    q, k (B, H, L, r), v (B, H, L, e), s (B, H, L, 1) key log-scales. Bidirectional: M = max s.
    Causal: chunks of ``chunk_size`` positions; M_i the running maximum, the state
    S = sum_j k_j [v_j, 1]^T kept in units of exp(m), m the maximum so far."""
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    if not causal:
        return q @ (k.transpose(-1, -2) @ (v1 * torch.exp(s - s.amax(-2, keepdim=True))))
    B, H, L, r = q.shape
    S = q.new_zeros(B, H, r, v1.shape[-1])
    m = q.new_full((B, H, 1, 1), torch.finfo(q.dtype).min)
    out = []
    for a in range(0, L, chunk_size):
        qc, kc, vc, sc = (t[:, :, a:a + chunk_size] for t in (q, k, v1, s))
        c = qc.shape[-2]
        M = torch.maximum(m, sc.cummax(dim=-2).values)                        # (B, H, c, 1)
        future = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
        weights = torch.exp((sc.transpose(-1, -2) - M).masked_fill(future, float("-inf")))  # exp(s_j - M_i)
        out.append((qc @ S) * torch.exp(m - M) + ((qc @ kc.transpose(-1, -2)) * weights) @ vc)
        last = M[:, :, -1:]
        S = S * torch.exp(m - last) + (kc * torch.exp(sc - last)).transpose(-1, -2) @ vc
        m = last
    return torch.cat(out, dim=-2)


def local_attention(q, k, v, window, causal, pad):
    """Exact softmax over the band of ``window`` positions, queries in blocks of ``window`` that see
    their block and its neighbours (before; and after, bidirectional), masked to the band."""
    B, H, L, d = q.shape
    w = max(1, min(int(window), L))  # a window past the protein sees all of it, at L x L cost (not window^2)
    N = -(-L // w)
    extra = N * w - L
    offsets = (-1, 0) if causal else (-1, 0, 1)

    def around(x, value=0.0):  # (..., L, d) -> (..., N, len(offsets) * w, d)
        x = F.pad(x, (0, 0, w, extra + w), value=value).view(*x.shape[:-2], N + 2, w, x.shape[-1])
        return torch.cat([x[..., 1 + o:1 + o + N, :, :] for o in offsets], dim=-2)

    keys, vals = around(k), around(v)
    qpos = torch.arange(N * w, device=q.device).view(N, w, 1)
    kpos = (torch.arange(N, device=q.device)[:, None] + offsets[0]) * w + torch.arange(len(offsets) * w, device=q.device)
    diff = qpos - kpos[:, None, :]  # key slot c of block n is position (n + offsets[0]) * w + c
    allowed = ((diff >= 0) & (diff < w)) if causal else (diff.abs() < w)
    allowed = allowed & ((kpos >= 0) & (kpos < L))[:, None, :]
    if pad is not None:
        kpad = around(pad[:, :, None].float(), value=1.0)[..., 0].bool()  # (B, N, n w)
        allowed = allowed & ~kpad[:, :, None, :]
    allowed = allowed | (diff == 0)
    out = F.scaled_dot_product_attention(F.pad(q, (0, 0, 0, extra)).view(B, H, N, w, d), keys, vals,
                                         attn_mask=allowed.unsqueeze(-4))
    return out.reshape(B, H, N * w, d)[:, :, :L]


class Attention(nn.Module):
    def __init__(self, config, causal):
        super().__init__()
        att = config.attention
        self.kernel = att.get("kernel", "softmax")
        if self.kernel not in LINEAR_KERNELS + ("exact",):
            raise ValueError(f"unknown attention kernel {self.kernel!r}")
        self.heads, self.head_dim = config.heads, config.dim // config.heads
        self.local_heads, self.local_window = int(att.get("local_heads", 0)), int(att.get("local_window", 128))
        self.causal, self.dropout = causal, config.dropout
        self.chunk_size = int(att.get("chunk_size") or 128)
        self.rotary = config.position == "rotary"
        self.float32_freqs = getattr(config, "rotary_inv_freq", "float64") == "float32"
        self.rotary_base = float(getattr(config, "rotary_base", ROTARY_BASE))
        self.to_qkv = nn.Linear(config.dim, 3 * config.dim, bias=bool(getattr(config, "qkv_bias", False)))
        self.to_out = nn.Linear(config.dim, config.dim)
        self.drop = nn.Dropout(config.dropout)
        self.feature_map = None if self.kernel == "exact" else FeatureMap(
            self.kernel, self.head_dim, self.heads - self.local_heads, int(att["nb_features"]),
            bool(att.get("relu_projection", True)))

    def forward(self, x, pad):
        B, L, _ = x.shape
        q, k, v = self.to_qkv(x).view(B, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rotary:
            q, k = (rotate(t, self.rotary_base, float32_freqs=self.float32_freqs) for t in (q, k))
        n, local = self.local_heads, None
        if n:
            local = local_attention(q[:, :n], k[:, :n], v[:, :n], self.local_window, self.causal, pad)
            q, k, v = q[:, n:], k[:, n:], v[:, n:]
        if self.feature_map is None:
            out = self._exact(q, k, v, pad)
        else:
            out = self.drop(self._linear(q, k, v, pad))
        if n:
            out = torch.cat([self.drop(local), out], dim=1)
        return self.to_out(out.transpose(1, 2).reshape(B, L, -1))

    def _exact(self, q, k, v, pad):
        p = self.dropout if self.training else 0.0
        if pad is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        L = q.shape[-2]
        allowed = ~pad[:, None, None, :]
        if self.causal:
            allowed = allowed & torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        allowed = allowed | torch.eye(L, dtype=torch.bool, device=q.device)  # no empty rows
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p)

    def _linear(self, q, k, v, pad):
        dtype = torch.promote_types(q.dtype, torch.float32)
        q, k, v32 = q.to(dtype), k.to(dtype), v.to(dtype)
        qf, _ = self.feature_map(q, is_query=True)
        kf, s = self.feature_map(k, is_query=False)
        if s is None:
            s = torch.zeros_like(kf[..., :1])
        if pad is not None:  # padded keys leave numerator and normalizer
            kf = kf.masked_fill(pad[:, None, :, None], 0.0)
            v32 = v32.masked_fill(pad[:, None, :, None], 0.0)
            s = s.masked_fill(pad[:, None, :, None], torch.finfo(dtype).min)
        nd = linear_attention(qf, kf, v32, s, self.causal, self.chunk_size)
        num, den = nd[..., :-1], nd[..., -1:]
        if self.kernel == "trig":
            den = torch.maximum(den, self.feature_map.normalizer_floor(k, self.causal, pad))
        else:
            den = den.clamp_min(torch.finfo(dtype).tiny)
        return (num / den).to(v.dtype)


class Block(nn.Module):
    def __init__(self, config, causal):
        super().__init__()
        eps = getattr(config, "norm_eps", 1e-5)
        self.norm1 = nn.LayerNorm(config.dim, eps=eps)
        self.attn = Attention(config, causal)
        self.norm2 = nn.LayerNorm(config.dim, eps=eps)
        self.ff = FeedForward(config.dim, config.ff_mult * config.dim, config.dropout)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x, pad):
        x = x + self.drop(self.attn(self.norm1(x), pad))
        return x + self.drop(self.ff(self.norm2(x)))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden, dropout):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Dropout(dropout)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


class EsmHead(nn.Module):
    """ESM's LM head before the tied projection (a model converted from ESM-2)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.dense, self.norm = nn.Linear(dim, dim), nn.LayerNorm(dim, eps=eps)

    def forward(self, h):
        return self.norm(F.gelu(self.dense(h)))


class ProteinPerformerPreTrainedModel(PreTrainedModel):
    """Common base; the parameter names are those of protein-performer's PerformerEncoder."""

    config_class = ProteinPerformerConfig
    base_model_prefix = "protein_performer"
    # the LM head's bias, in every exported model.safetensors: the backbone alone does not use it
    _keys_to_ignore_on_load_unexpected = [r"^(protein_performer\.)?head_bias$", r"^(protein_performer\.)?lm_head\."]

    def _init_weights(self, module):
        """Nothing to initialize: every weight comes from model.safetensors."""


class ProteinPerformerModel(ProteinPerformerPreTrainedModel):
    """The backbone (``AutoModel``): tokens -> hidden states after the final norm, (B, L, dim)."""

    def __init__(self, config):
        super().__init__(config)
        if config.position not in ("rotary", "learned"):
            raise ValueError(f"position must be 'rotary' or 'learned', got {config.position!r}")
        causal = config.objective == "clm"
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embed = nn.Embedding(config.max_positions, config.dim) if config.position == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, causal) for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.dim, eps=getattr(config, "norm_eps", 1e-5))
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None, return_dict=None, **kwargs):
        """input_ids (B, L); attention_mask (B, L), 1 = token, 0 = padding -> last_hidden_state (B, L, dim)
        and, when asked for, the hidden states (embedding, each block, final norm)."""
        pad = None if attention_mask is None else attention_mask == 0
        if pad is not None and not pad.any():
            pad = None
        x = self.embed(input_ids.long())
        if getattr(self.config, "token_dropout", False):  # ESM-2's: <mask> zeroed, all scaled by 0.88 / (1 - masked)
            masked = input_ids == self.config.mask_token_id
            lengths = input_ids.shape[1] if pad is None else (~pad).sum(-1)
            observed = masked.sum(-1).float() / lengths
            x = x.masked_fill(masked.unsqueeze(-1), 0.0)
            x = (x * (1 - 0.15 * 0.8) / (1 - observed)[:, None, None]).to(x.dtype)
        if self.pos_embed is not None:
            L = input_ids.shape[1]
            if L > self.config.max_positions:
                raise ValueError(f"{L} tokens exceed the learned positions (max_positions={self.config.max_positions})")
            x = x + self.pos_embed(torch.arange(L, device=x.device))
        x = self.drop(x)
        hidden = [x]
        for block in self.blocks:
            x = block(x, pad)
            hidden.append(x)
        h = self.norm(x)
        hidden[-1] = h
        out = BaseModelOutput(last_hidden_state=h, hidden_states=tuple(hidden) if output_hidden_states else None)
        return out if return_dict is not False else out.to_tuple()


class ProteinPerformerLMHeadModel(ProteinPerformerPreTrainedModel):
    """The backbone with the language-model head tied to its embedding: logits = h E^T + head_bias."""

    objective = None  # set by the subclasses: which objective's models they open

    def __init__(self, config):
        super().__init__(config)
        if config.objective != self.objective:
            other = "AutoModelForCausalLM" if config.objective == "clm" else "AutoModelForMaskedLM"
            raise ValueError(f"this is a {config.objective} model: open it with {other}")
        self.protein_performer = ProteinPerformerModel(config)
        # The bias is registered on the backbone, so that its key is <prefix>.head_bias: model.safetensors
        # holds the backbone's tensors without the prefix, and head_bias among them; transformers adds
        # the prefix to all of them at once (4.x) or to each one the model has under it (5.x).
        self.protein_performer.head_bias = nn.Parameter(torch.zeros(config.vocab_size))
        if getattr(config, "lm_head", "tied") == "esm":  # ESM's: dense, GELU, LayerNorm before the tied projection
            self.protein_performer.lm_head = EsmHead(config.dim, getattr(config, "norm_eps", 1e-5))
        self.post_init()

    def _logits(self, input_ids, attention_mask, output_hidden_states):
        base = self.protein_performer
        out = base(input_ids, attention_mask, output_hidden_states=output_hidden_states, return_dict=True)
        h = out.last_hidden_state
        if getattr(base, "lm_head", None) is not None:
            h = base.lm_head(h)
        return F.linear(h, base.embed.weight, base.head_bias), out.hidden_states


class ProteinPerformerForMaskedLM(ProteinPerformerLMHeadModel):
    """Bidirectional (objective mlm) model: logits at every position; loss over labels != -100."""

    objective = "mlm"

    def forward(self, input_ids, attention_mask=None, labels=None, output_hidden_states=None, return_dict=None,
                **kwargs):
        logits, hidden = self._logits(input_ids, attention_mask, output_hidden_states)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        out = MaskedLMOutput(loss=loss, logits=logits, hidden_states=hidden)
        return out if return_dict is not False else out.to_tuple()


class ProteinPerformerForCausalLM(ProteinPerformerLMHeadModel):
    """Causal (objective clm) model: logits at position i predict token i + 1; loss over shifted labels."""

    objective = "clm"

    def forward(self, input_ids, attention_mask=None, labels=None, output_hidden_states=None, return_dict=None,
                **kwargs):
        logits, hidden = self._logits(input_ids, attention_mask, output_hidden_states)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        out = CausalLMOutput(loss=loss, logits=logits, hidden_states=hidden)
        return out if return_dict is not False else out.to_tuple()


class PoolingHead(nn.Module):
    """protein-performer's SequenceClassificationHead (mean) / AttentionPoolingHead (attention) /
    LayerMeansHead (layers: the mean of every hidden state, side by side; termini: and the last one's mean
    over the first and the last ``ends`` residues): the hidden states pooled over the residues, then dropout
    and a linear layer."""

    def __init__(self, dim, num_labels, pooling, dropout, layers=1, ends=0):
        super().__init__()
        if pooling not in ("mean", "attention", "layers", "termini"):
            raise ValueError(f"pooling must be 'mean', 'attention', 'layers' or 'termini', got {pooling!r}")
        if pooling == "termini" and not ends:
            raise ValueError("pooling='termini' needs the config's pooling_ends (residues at each end)")
        self.pooling, self.ends = pooling, int(ends) if pooling == "termini" else 0
        if pooling == "attention":  # a learned score per residue, softmax over the protein's residues
            self.score = nn.Linear(dim, 1)
        self.drop = nn.Dropout(dropout)
        width = layers + (2 if self.ends else 0) if pooling in ("layers", "termini") else 1
        self.out = nn.Linear(dim * width, num_labels)

    def forward(self, h, residues):
        """h: the last hidden state (B, L, dim), or (pooling=layers, termini) every hidden state."""
        if self.pooling in ("layers", "termini"):
            means = [_mean(x, residues) for x in h]
            if self.ends:  # protein_performer.model.pooling.end_masks, copied to stand alone
                seen = residues.long().cumsum(-1)
                means += [_mean(h[-1], residues & (seen <= self.ends)),
                          _mean(h[-1], residues & (seen > seen[..., -1:] - self.ends))]
            return self.out(self.drop(torch.cat(means, -1)))
        if self.pooling == "mean":
            pooled = _mean(h, residues)
        else:
            s = self.score(h).squeeze(-1).float().masked_fill(~residues, float("-inf"))
            pooled = torch.einsum("bl,bld->bd", torch.softmax(s, -1).nan_to_num(0.0).to(h.dtype), h)
        return self.out(self.drop(pooled))


def _mean(h, residues):
    """protein_performer.model.pooling.masked_mean, copied to stand alone: the mean over the residues."""
    m = residues.to(h.dtype)[..., None]
    return (h * m).sum(1) / m.sum(1).clamp_min(1)


class TokenHead(nn.Module):
    """protein-performer's TokenClassificationHead: dropout and a linear layer at every position, plus
    (``window`` w > 0) a convolution over the residues' hidden states w on either side."""

    def __init__(self, dim, num_labels, dropout, window=0):
        super().__init__()
        self.drop, self.out = nn.Dropout(dropout), nn.Linear(dim, num_labels)
        self.context = nn.Conv1d(dim, num_labels, 2 * window + 1, padding=window, bias=False) if window else None

    def forward(self, h, residues):
        x = self.drop(h)
        y = self.out(x)
        if self.context is not None:
            x = x * residues.unsqueeze(-1).to(x.dtype)
            y = y + self.context(x.transpose(1, 2)).transpose(1, 2)
        return y


def mix_outputs(tuned, probe, share, task):
    """finetune's output-space ensemble: ``share`` of the fine-tuned network's outputs and the rest of the
    probe's; classes: the log of the mixed probabilities. A standalone copy of
    protein_performer.model.heads.mix_outputs (tests/test_finetune_ensemble.py compares the two)."""
    if task == "regression":
        return share * tuned.float() + (1 - share) * probe.float()
    return torch.logaddexp(F.log_softmax(tuned.float(), -1) + math.log(share),
                           F.log_softmax(probe.float(), -1) + math.log1p(-share))


class ProteinPerformerTaskModel(ProteinPerformerPreTrainedModel):
    """The backbone and a fine-tuned task head (an export of ``protein-performer finetune``). The
    parameter names are those of protein-performer's fine-tuned network, ``encoder.*`` and
    ``head.*``, hence the prefix. Regression logits are in standardized units: the prediction is
    ``logits * target_scale[1] + target_scale[0]``, as protein-performer's ``predictions.csv``.
    With ``config.ensemble_share`` set (finetune's default ensemble), ``probe.encoder.*`` and
    ``probe.head.*`` hold the frozen checkpoint and its linear probe, and the logits are the log of
    the mixed probabilities (regression: the mixed standardized values)."""

    base_model_prefix = "encoder"
    per_residue = None  # set by the subclasses

    def __init__(self, config):
        super().__init__(config)
        task = getattr(config, "finetune_task", None)
        if task is None:
            raise ValueError("this directory holds a language model, no task head: open it with "
                             "AutoModelForMaskedLM, AutoModelForCausalLM or AutoModel")
        if (task == "residue") != self.per_residue:
            other = "AutoModelForTokenClassification" if task == "residue" else "AutoModelForSequenceClassification"
            raise ValueError(f"this is a {task} head: open it with {other}")
        self.num_labels = config.num_labels
        self.encoder, self.head = self._backbone_and_head(config)
        self.share = getattr(config, "ensemble_share", None)
        self.probe = None
        if self.share is not None:
            self.probe = nn.Module()
            self.probe.encoder, self.probe.head = self._backbone_and_head(config)
        self.post_init()

    def _backbone_and_head(self, config):
        dropout = getattr(config, "classifier_dropout", None) or 0.0
        return ProteinPerformerModel(config), (
            TokenHead(config.dim, config.num_labels, dropout, getattr(config, "head_window", 0) or 0)
            if self.per_residue else
            PoolingHead(config.dim, config.num_labels, getattr(config, "pooling", "mean"), dropout, config.depth + 1,
                        getattr(config, "pooling_ends", 0) or 0))

    def _logits(self, input_ids, attention_mask, output_hidden_states):
        """The head's logits (mixed with the probe's where the export is an ensemble) and the encoder's output."""
        residues = self._residues(input_ids)
        layers = not self.per_residue and getattr(self.config, "pooling", "mean") in ("layers", "termini")  # every hidden state
        out = self._hidden(input_ids, attention_mask, output_hidden_states or layers)
        logits = self.head(out.hidden_states if layers else out.last_hidden_state, residues)
        if self.probe is not None:
            o = self.probe.encoder(input_ids, attention_mask, output_hidden_states=layers, return_dict=True)
            logits = mix_outputs(logits, self.probe.head(o.hidden_states if layers else o.last_hidden_state, residues),
                                 self.share, self.config.finetune_task)
        if layers and not output_hidden_states:  # read for the head, not asked for
            out = BaseModelOutput(last_hidden_state=out.last_hidden_state)
        return logits, out

    def _residues(self, input_ids):
        """True at residues: every token but padding, <cls> and <eos>. A standalone copy (this file
        runs without protein-performer) of protein_performer.model.pooling.residue_mask: keep the two
        alike (tests/test_hf_heads.py compares the outputs)."""
        c = self.config
        return (input_ids != c.pad_token_id) & (input_ids != c.bos_token_id) & (input_ids != c.eos_token_id)

    def _hidden(self, input_ids, attention_mask, output_hidden_states):
        return self.encoder(input_ids, attention_mask, output_hidden_states=output_hidden_states, return_dict=True)

    def _loss(self, logits, labels):
        if labels is None:
            return None
        if self.config.problem_type == "regression":
            mean, std = getattr(self.config, "target_scale", None) or (0.0, 1.0)
            return F.mse_loss(logits.squeeze(-1).float(), (labels.float() - mean) / std)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)


class ProteinPerformerForSequenceClassification(ProteinPerformerTaskModel):
    """A class (logits) or a value (regression, one standardized output) per protein, pooled over its
    residues (every token but padding, <cls> and <eos>)."""

    per_residue = False

    def forward(self, input_ids, attention_mask=None, labels=None, output_hidden_states=None, return_dict=None,
                **kwargs):
        logits, out = self._logits(input_ids, attention_mask, output_hidden_states)
        result = SequenceClassifierOutput(loss=self._loss(logits, labels), logits=logits,
                                          hidden_states=out.hidden_states)
        return result if return_dict is not False else result.to_tuple()


class ProteinPerformerForTokenClassification(ProteinPerformerTaskModel):
    """A class per position (e.g. secondary structure per residue); the loss skips labels -100
    (give them at <cls>, <eos> and padding)."""

    per_residue = True

    def forward(self, input_ids, attention_mask=None, labels=None, output_hidden_states=None, return_dict=None,
                **kwargs):
        logits, out = self._logits(input_ids, attention_mask, output_hidden_states)
        result = TokenClassifierOutput(loss=self._loss(logits, labels), logits=logits,
                                       hidden_states=out.hidden_states)
        return result if return_dict is not False else result.to_tuple()
