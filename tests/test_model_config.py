"""The typed model config: conf/model variants are small overrides of one base file, every
key reaches the model under one name, and a wrong key is a one-line error naming it."""
import pytest
from hydra import compose, initialize_config_dir

from protein_performer.errors import UserError
from protein_performer.model import ModelConfig, PerformerLM
from protein_performer.training.task import ProteinLM

KERNEL = {"performer": "softmax", "performer_relu": "relu", "favorpp": "favor++", "linear": "elu",
          "transformer": "exact"}


def compose_model(root, *overrides):
    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides)).model


@pytest.mark.parametrize("variant", sorted(KERNEL))
def test_variants_differ_from_the_base_only_in_kernel_and_name(root, variant):
    base = dict(compose_model(root, "model=base"))
    cfg = dict(compose_model(root, f"model={variant}"))
    assert set(cfg) == set(base)
    assert {k for k in cfg if cfg[k] != base[k]} <= {"name", "attention"}
    # the exact transformer also drops the local heads (all its heads see the whole protein)
    changed = {"kernel", "local_heads"} if KERNEL[variant] == "exact" else {"kernel"}
    assert {k for k in cfg["attention"] if cfg["attention"][k] != base["attention"][k]} <= changed
    assert all(b.attn.local_heads == (0 if KERNEL[variant] == "exact" else 1) for b in PerformerLM(
        ModelConfig.from_dict(cfg)).blocks)
    config = ModelConfig.from_dict(cfg)
    assert config.attention.kernel == KERNEL[variant]
    net = PerformerLM(config)
    assert all(b.attn.kernel == KERNEL[variant] for b in net.blocks)
    assert all(b.attn.chunk_size == cfg["attention"]["chunk_size"] for b in net.blocks)
    expected = {"exact": None, "elu": cfg["dim"] // cfg["heads"]}.get(KERNEL[variant], cfg["attention"]["nb_features"])
    assert net.blocks[0].attn.num_features == expected
    dh = cfg["dim"] // cfg["heads"]  # the configured rotary base sets the frequencies: theta_1 = base^(-2/dh)
    assert abs(float(net.blocks[0].attn.rotary.inv_freq[1]) / cfg["rotary_base"] ** (-2 / dh) - 1) < 1e-6


def test_unknown_keys_are_named():
    with pytest.raises(UserError, match=r"model\.attention\.kernal: unknown key"):
        ProteinLM(model={"dim": 32, "heads": 2, "attention": {"kernal": "relu"}})
    with pytest.raises(UserError, match=r"model\.widht: unknown key"):
        ModelConfig.from_dict({"widht": 3})
    with pytest.raises(UserError, match="model.dim=30 is not divisible by model.heads=4"):
        ModelConfig(dim=30, heads=4)


def test_old_checkpoints_max_len_is_max_positions():
    old = ProteinLM(model={"dim": 32, "heads": 2, "position": "learned", "max_len": 48})
    assert old.model.config.max_positions == 48 and old.model.pos_embed.num_embeddings == 48
    assert PerformerLM(dim=32, heads=2, position="learned", max_len=40).max_positions == 40


def test_crop_longer_than_learned_positions_is_refused_before_training(tmp_path):
    import pytorch_lightning as pl

    from conftest import SAMPLE
    from protein_performer.data.datamodule import ProteinDataModule
    task = ProteinLM(model={"dim": 32, "heads": 2, "depth": 1, "position": "learned", "max_positions": 32})
    dm = ProteinDataModule(str(SAMPLE), max_len=64, batch_size=4, max_records=60, valid_fraction=0.2)
    t = pl.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                   enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
    with pytest.raises(UserError, match=r"data.max_len=64 is longer than the model's learned positions "
                                        r"\(model.max_positions=32\)"):
        t.fit(task, datamodule=dm)
    dm = ProteinDataModule(str(SAMPLE), max_len=32, batch_size=4, max_records=60, valid_fraction=0.2)
    t.fit(task, datamodule=dm)  # fits: trains
    assert t.global_step == 1


def test_nb_features_has_one_default():
    """ModelConfig, Attention, build_feature_map and every feature map take the same default
    number of features (declared once: attention.feature_maps.NB_FEATURES)."""
    import inspect

    from protein_performer.attention import Attention, build_feature_map
    from protein_performer.attention import feature_maps as fm
    from protein_performer.model import AttentionConfig
    defaults = {AttentionConfig().nb_features}
    for f in (Attention, build_feature_map, fm.FavorPlus, fm.FavorPlusPlus, fm.TrigFeatures, fm.ReluFeatures,
              fm.HedgehogFeatures):
        defaults.add(inspect.signature(f).parameters["nb_features"].default)
    assert defaults == {fm.NB_FEATURES} == {64}
    assert Attention(32, 2).num_features == 64  # the model's FAVOR+ gets what the config says
