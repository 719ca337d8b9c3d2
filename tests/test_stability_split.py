"""benchmarks/stability_split.py's counts on sequences whose links are known by hand."""
from benchmarks.stability_split import by_mask, clusters, neighbours_in


def test_single_substitution_links_by_hand():
    # AAAA-AAAC-AACC chain by single substitutions (AAAA and AACC are two apart); GGGG stands alone
    sizes = sorted(clusters(["AAAA", "AAAC", "AACC", "GGGG"]).values())
    assert sizes == [1, 3]
    train = by_mask(["AAAA", "CCCC"])
    # AAAT: one from AAAA; CCGG: two from CCCC; AAAA itself is not its own neighbour
    assert neighbours_in(["AAAT", "CCGG", "TTTT"], train) == 1
    assert neighbours_in(["AAAA"], by_mask(["AAAA"])) == 0
