"""benchmarks/speed/launches.py's proxy for GPU launches: the per-layer op count of the model's parallel path
(what CUDA runs where fla does not) does not grow with the length; the CPU path's does (its loop)."""
from benchmarks.speed.launches import KERNELS, count_aten_ops, layer_ops

DEFAULT = KERNELS["default (FAVOR+ r = 64 + local head)"]


def test_counting_sees_every_op_of_a_known_call():
    import torch
    x = torch.ones(3)
    n_all, n_kernels = count_aten_ops(lambda: (x + 1).view(3, 1).mul(2))   # add, view, mul
    assert (n_all, n_kernels) == (3, 2)


def test_the_parallel_causal_layer_costs_the_same_ops_at_every_length():
    counts = {L: layer_ops(DEFAULT, True, L, "parallel") for L in (256, 2048)}
    assert counts[256] == counts[2048], counts
    seq = {L: layer_ops(DEFAULT, True, L, "torch")[0] for L in (256, 2048)}
    assert seq[2048] > 2 * seq[256], seq                      # the CPU path: a few ops per chunk
    bidir = {L: layer_ops(DEFAULT, False, L, "parallel") for L in (256, 2048)}
    assert bidir[256] == bidir[2048], bidir


def test_the_causal_default_on_the_cuda_path_stays_within_three_times_exact():
    """Issue 42's CPU proxy goal, held in every session: the default causal layer on `parallel` dispatches
    at most 3x the ops of an exact-attention layer (docs/launches.md: 2.73x); the bidirectional default may
    not grow past its measured 1.73x either (goal 1.5x: not met, so not loosened silently), and FAVOR+
    without the local head stays within the 1.5x (1.42x)."""
    exact = layer_ops(KERNELS["exact"], True, 256, "parallel")[0]
    causal = layer_ops(DEFAULT, True, 256, "parallel")[0]
    assert causal <= 3 * exact, (causal, exact)
    exact = layer_ops(KERNELS["exact"], False, 256, "parallel")[0]
    bidir = layer_ops(DEFAULT, False, 256, "parallel")[0]
    assert bidir <= 1.75 * exact, (bidir, exact)
    favor = layer_ops(KERNELS["FAVOR+ r = 64"], False, 256, "parallel")[0]
    assert favor <= 1.5 * exact, (favor, exact)
