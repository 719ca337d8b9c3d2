"""``compile=true``: the torch.compile'd model (C++ kernels generated on CPU) gives the eager
model's logits and gradients.  Compiling takes tens of seconds, so one small model per mode."""
import copy

import pytest
import torch

from protein_performer.model import PerformerLM
from protein_performer.tokenizer import Tokenizer


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_model_matches_eager(causal):
    torch.manual_seed(0)
    eager = PerformerLM(vocab_size=Tokenizer().vocab_size, dim=32, depth=1, heads=2, dropout=0.0, causal=causal,
                        attention={"kernel": "softmax", "nb_features": 16, "chunk_size": 8, "redraw_interval": 0})
    compiled = copy.deepcopy(eager)
    compiled.compile()
    tokens = torch.randint(5, 25, (2, 37))
    pad = torch.zeros(2, 37, dtype=torch.bool)
    pad[1, 30:] = True
    outs = []
    for m in (eager, compiled):
        logits = m(tokens, pad)
        logits[:, :30].square().mean().backward()
        outs.append((logits.detach(), m.embed.weight.grad.clone(), m.blocks[0].attn.to_qkv.weight.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
