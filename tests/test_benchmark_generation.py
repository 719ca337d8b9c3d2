"""benchmarks/speed/generation.py's synthetic decoding states against real ones: the state it builds for
position p must have the shapes (and so the bytes) of the state that decoding p - 1 tokens leaves,
the local heads' bounded key/value cache included."""
from types import SimpleNamespace

import torch

from benchmarks.speed import generation


def _shapes(state):
    return [{k: (tuple(t.shape for t in v) if isinstance(v, tuple) else getattr(v, "shape", v))
             for k, v in layer.items()} for layer in state["layers"]]


@torch.no_grad()
def test_synthetic_state_matches_decoding():
    args = SimpleNamespace(dim=32, depth=2, heads=4, nb_features=16, local_heads=1, local_window=8)
    model = generation.build("softmax", args)
    for p in (1, 5, 20):   # before, inside and past the window's cache of window - 1 = 7 positions
        state = model.init_state(1)
        token = torch.tensor([generation.TOK.cls_id])
        for _ in range(p - 1):
            _, state = model.step(token, state)
        fake = generation.rnn_state_at(model, p)
        assert _shapes(fake) == _shapes(state) and fake["pos"] == state["pos"] == p - 1
        # bytes by hand: per layer, S (3 heads x r x d) + Z (3 x r) + m (3) in fp32, and the local head's
        # keys and values of min(p - 1, 7) positions
        d, r, n = 8, 16, min(p - 1, 7)
        per_layer = 4 * (3 * r * d + 3 * r + 3) + 4 * 2 * n * d
        assert generation.state_bytes(state) == generation.state_bytes(fake) == args.depth * per_layer
        # and the model decodes from it as from the real one: the next states have the same shapes
        _, after_real = model.step(token, state)
        _, after_fake = model.step(token, generation.clone_state(fake))
        assert _shapes(after_fake) == _shapes(after_real)
