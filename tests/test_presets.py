"""GPU-sized model presets (conf/model/size/): ``model/size=8m|35m|150m|650m`` gives ESM-2's shapes over
any variant, changes nothing else, and leaves the defaults alone when not given."""
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from protein_performer.errors import UserError
from protein_performer.model import ModelConfig, PerformerLM

# ESM-2 (Lin et al. 2023; fair-esm's esm2_t{layers}_{size}_UR50D, transformers' EsmConfig of each):
# layers, embedding dim, attention heads; feed-forward 4 x dim in all of them
ESM2 = {"8m": (6, 320, 20), "35m": (12, 480, 20), "150m": (30, 640, 20), "650m": (33, 1280, 20)}
SHAPE = ("depth", "dim", "heads", "ff_mult")


def compose_model(root, *overrides) -> dict:
    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        return OmegaConf.to_container(compose("train", overrides=list(overrides)).model)


@pytest.mark.parametrize("variant", ["performer", "transformer", "linear"])
@pytest.mark.parametrize("size", sorted(ESM2))
def test_size_sets_esm2_shape_and_nothing_else(root, size, variant):
    plain = compose_model(root, f"model={variant}")
    cfg = compose_model(root, f"model={variant}", f"model/size={size}")
    depth, dim, heads = ESM2[size]
    assert (cfg["depth"], cfg["dim"], cfg["heads"], cfg["ff_mult"]) == (depth, dim, heads, 4)
    assert set(cfg) == set(plain)  # no stray key (e.g. a 'size' node)
    assert {k for k in cfg if cfg[k] != plain[k]} <= set(SHAPE)
    assert cfg["attention"] == plain["attention"]  # kernel, features, local heads: the variant's
    config = ModelConfig.from_dict(cfg)  # every preset is a valid model (head dim even for rotary)
    assert config.dim // config.heads == dim // 20


def test_without_size_the_defaults_are_unchanged(root):
    cfg = compose_model(root, "model=performer")
    assert cfg == compose_model(root)  # model=performer is the default
    assert {k: cfg[k] for k in SHAPE} == {"depth": 4, "dim": 128, "heads": 4, "ff_mult": 4}
    assert (cfg["attention"]["kernel"], cfg["attention"]["nb_features"], cfg["attention"]["local_heads"],
            cfg["attention"]["local_window"]) == ("softmax", 64, 1, 128)
    assert "size" not in cfg


def test_a_command_line_override_beats_the_preset(root):
    cfg = compose_model(root, "model/size=35m", "model.depth=2", "model.attention.kernel=elu")
    assert (cfg["depth"], cfg["dim"], cfg["heads"], cfg["attention"]["kernel"]) == (2, 480, 20, "elu")


def test_unknown_size_is_a_one_line_error_listing_the_sizes():
    from protein_performer.cli import compose as cli_compose
    with pytest.raises(UserError) as e:
        cli_compose("train", ["model/size=36m"])
    assert "36m" in str(e.value) and all(s in str(e.value) for s in ESM2)


def _parameters(net) -> int:
    return sum(p.numel() for p in net.parameters())


def test_8m_builds_with_the_hand_counted_parameters(root):
    """Per block: two LayerNorms (4d), q, k, v without bias (3d^2), the output projection (d^2 + d),
    the feed-forward (8d^2 + 5d); the tied embedding (V d), the final LayerNorm (2d), the output bias (V).
    Random features and the local head add no parameter."""
    cfg = compose_model(root, "model/size=8m")
    config = ModelConfig.from_dict(cfg)
    net = PerformerLM(config)
    assert net.depth == 6 and all(b.attn.local_heads == 1 for b in net.blocks)
    d, depth, V = 320, 6, config.vocab_size
    assert _parameters(net) == depth * (12 * d * d + 10 * d) + V * d + 2 * d + V


def test_8m_with_esm_heads_has_esm2_8m_parameter_count(root):
    """The 8m shape with what ESM-2 has besides (its 33 tokens, biased q, k, v, its LM head) counts
    exactly fair-esm's ESM-2 8M parameters, less its contact head (not part of this model)."""
    esm = pytest.importorskip("esm")
    ref = esm.model.esm2.ESM2(num_layers=6, embed_dim=320, attention_heads=20)
    expected = _parameters(ref) - _parameters(ref.contact_head)
    cfg = compose_model(root, "model/size=8m")
    for kernel in ("softmax", "exact"):
        cfg["attention"]["kernel"] = kernel
        net = PerformerLM(ModelConfig.from_dict(cfg, vocab_size=33, vocabulary="esm", qkv_bias=True, lm_head="esm"))
        assert _parameters(net) == expected, kernel
