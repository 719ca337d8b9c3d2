"""benchmarks/quality/probe_features.py: the feature sets a probe is compared on, built from arrays written here."""
import numpy as np

from benchmarks.quality import probe_features


def test_feature_sets_stack_layers_and_composition_in_order():
    depth, n = 2, 3
    grid = {("mean", i): np.full((n, 2), float(i + 1)) for i in range(depth + 1)}   # layer i: all i + 1
    grid["max", depth] = np.full((n, 2), -9.0)                                         # never used
    comp = np.arange(n * 20, dtype=float).reshape(n, 20)
    sets = probe_features.feature_sets(grid, comp, depth)
    assert set(sets) == set(probe_features.FEATURES)
    np.testing.assert_array_equal(sets["last"], np.full((n, 2), 3.0))
    np.testing.assert_array_equal(sets["layers"], np.repeat([[1.0, 1, 2, 2, 3, 3]], n, 0))
    np.testing.assert_array_equal(sets["last+composition"][:, 2:], comp)
    np.testing.assert_array_equal(sets["last+composition"][:, :2], 3.0)
    np.testing.assert_array_equal(sets["layers+composition"], np.concatenate([sets["layers"], comp], 1))
