"""data/labeled/scripts/stability_split.py's counts on sequences whose links are known by hand."""
from stability_split import by_mask, clusters, near_training


def test_single_substitution_links_by_hand():
    # AAAA-AAAC-AACC chain by single substitutions (AAAA and AACC are two apart); GGGG stands alone
    assert sorted(clusters(["AAAA", "AAAC", "AACC", "GGGG"]).values()) == [1, 3]
    train = ["AAAA", "CCCC"]
    # AAAA: identical; AAAT: one from AAAA; CCGG: two from CCCC; TTTT: far from both
    assert near_training(["AAAA", "AAAT", "CCGG", "TTTT"], set(train), by_mask(train)) == (1, 1)
