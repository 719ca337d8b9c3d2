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


# --- one truth for the defaults, and the files saved under the old ones (issue 43, item 4) ---------------
def test_the_dataclass_defaults_are_the_base_configs(root):
    """ModelConfig() is conf/model/base.yaml: every key the file sets has the dataclass's value."""
    from dataclasses import asdict
    base = dict(compose_model(root, "model=base"))
    base.pop("name")
    ours = asdict(ModelConfig())
    for key, value in base.items():
        if key == "attention":
            assert {k: ours["attention"][k] for k in value} == dict(value)
        else:
            assert ours[key] == value, key


def test_migrate_fills_what_version_1_left_out():
    from protein_performer.model.config import CONFIG_VERSION, migrate
    old = {"dim": 32, "attention": {"kernel": "softmax"}}                      # as written before the version key
    assert migrate(old) == {"dim": 32, "attention": {"kernel": "softmax", "local_heads": 0},
                            "rotary_base": 10000.0, "dropout": 0.1, "config_version": CONFIG_VERSION}
    assert migrate({"dim": 32, "config_version": 2})["dropout"] == 0.1    # version 2's default: 0.1
    assert migrate({"dim": 32, "dropout": 0.3, "config_version": 2})["dropout"] == 0.3
    kept = {"dim": 32, "rotary_base": 500.0, "attention": {"local_heads": 2}}  # what a file says stands
    assert migrate(kept)["rotary_base"] == 500.0 and migrate(kept)["attention"] == {"local_heads": 2}
    new = ModelConfig(dim=32, heads=2).to_dict()
    assert migrate(new) == new                                                  # the current version: as it is
    with pytest.raises(UserError, match=r"^ckpt: config_version 4: written by another protein-performer"):
        migrate({**new, "config_version": 4}, "ckpt")


def _old_task():
    """A model as version 1 built it from a partial dict: RoFormer's rotary base, no local heads."""
    import torch
    torch.manual_seed(0)
    task = ProteinLM(model=dict(dim=32, depth=2, heads=2, dropout=0.0, rotary_base=10000.0,
                                attention=dict(kernel="softmax", nb_features=16, local_heads=0))).eval()
    with torch.no_grad():
        for p in task.model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return task


def test_a_version_1_checkpoint_loads_as_it_was_trained(tmp_path):
    """A checkpoint whose hyperparameters hold the partial model dict of version 1 (no config_version,
    no rotary_base, no local_heads) gives the logits of the model it was saved from."""
    import torch

    from conftest import save_checkpoint
    from protein_performer.model.config import CONFIG_VERSION
    from protein_performer.training.task import load_checkpoint
    task = _old_task()
    path = save_checkpoint(task, tmp_path / "old.ckpt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["hyper_parameters"]["model"] = {"dim": 32, "depth": 2, "heads": 2, "dropout": 0.0,
                                         "attention": {"kernel": "softmax", "nb_features": 16}}
    torch.save(ckpt, path)
    loaded = load_checkpoint(path)
    assert loaded.model.config.rotary_base == 10000.0 and loaded.model.config.attention.local_heads == 0
    tokens = torch.randint(4, 24, (2, 40))
    torch.testing.assert_close(loaded.model(tokens), task.model(tokens), rtol=0, atol=0)
    fresh = ProteinLM(model={"dim": 32, "depth": 2, "heads": 2})             # a new model: the new defaults
    assert fresh.model.config.rotary_base == 1e6 and fresh.model.config.attention.local_heads == 1
    assert fresh.model.config.dropout == 0.0 and fresh.hparams.model["config_version"] == CONFIG_VERSION


def test_a_version_1_export_loads_as_it_was_trained(tmp_path):
    """An exported directory whose config.json was written by version 1 (no config_version; local_heads
    left out when 0, rotary_base written) gives the logits of the model it was exported from."""
    import json

    import torch

    from conftest import save_checkpoint
    from protein_performer.hub.export import export
    from protein_performer.hub.load import load_pretrained
    task = _old_task()
    out = export(save_checkpoint(task, tmp_path / "m.ckpt"), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    del config["config_version"], config["attention"]["local_heads"], config["attention"]["local_window"]
    (out / "config.json").write_text(json.dumps(config))
    model, _ = load_pretrained(out)
    assert model.config.attention.local_heads == 0 and model.config.rotary_base == 10000.0
    tokens = torch.randint(4, 24, (2, 40))
    torch.testing.assert_close(model(tokens), task.model(tokens), rtol=0, atol=0)
