"""protein_performer/finetune/ split by layer (issue 43): the same seeds give the same results as the
single-module finetune.py did. REFERENCE below was produced by the pre-split code (the same calls,
same seeds, this file's ``run_case``); and no function in the package is longer than 80 lines."""
import ast
import csv
import json
import random

import pytest
import torch

from protein_performer import finetune as FT
from protein_performer.training.task import ProteinLM

from conftest import ROOT, save_checkpoint

AA = "ACDEFGHIKLMNPQRSTVWY"
#: conftest's tiny model with every setting whose default has changed spelled out, so the reference
#: holds whatever ModelConfig() says
MODEL = dict(dim=32, depth=2, heads=2, dropout=0.0, position="rotary", rotary_base=10000.0,
             attention=dict(kernel="softmax", nb_features=16, local_heads=0))
#: what each case gives finetune besides ckpt, labels, task and output_dir: a few steps each
FAST = dict(lr=3e-3, head_lr=1e-2, max_tokens=600, patience=30, progress_every=None, progress_seconds=None,
            trainer={"max_epochs": 3, "max_steps": 6, "enable_progress_bar": False})
CASES = {
    "classification": dict(task="classification", kw=dict(seed=1)),
    "classification_probe": dict(task="classification", kw=dict(head_init="probe", pooling="attention", seed=2)),
    "multiclass_drawn_splits": dict(task="classification", split=False, kw=dict(seed=3, schedule="constant")),
    "regression_probe": dict(task="regression", kw=dict(head_init="probe", seed=4)),
    "residue": dict(task="residue", kw=dict(seed=5, window=2)),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    task = ProteinLM(model=MODEL, objective="mlm").eval()
    return save_checkpoint(task, tmp_path_factory.mktemp("ft_split") / "mlm.ckpt")


def labels_csv(path, task: str, split: bool = True):
    """A small labels CSV: 40 proteins of 20-40 residues, with a split column (or not)."""
    rng = random.Random(7)
    classes = ("D", "K", "W") if not split else ("many_K", "few_K")
    rows = []
    for k in range(40):
        seq = "".join(rng.choice(AA) for _ in range(rng.randint(20, 40)))
        if task == "regression":
            label = f"{seq.count('K') / len(seq) + 0.1 * rng.random():.6f}"
        elif task == "residue":
            label = "".join("H" if a in "AELMQK" else "E" if a in "VIYFWT" else "C" for a in seq)
        else:
            label = classes[k % len(classes)]
        part = "test" if k % 5 == 0 else "valid" if k % 5 == 1 else "train"
        rows.append([f"p{k}", seq, label] + ([part] if split else []))
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "sequence", "label"] + (["split"] if split else []))
        w.writerows(rows)
    return path


def run_case(ckpt, tmp_path, name: str) -> dict:
    """finetune on the case's labels: predictions.csv's rows, metrics.json and finetune.json
    (less what differs from run to run or belongs to the model's config: the time taken, the
    checkpoint's path, the encoder's config)."""
    case = CASES[name]
    labels = labels_csv(tmp_path / f"{name}.csv", case["task"], case.get("split", True))
    out = tmp_path / name
    FT.finetune(ckpt, labels, case["task"], out, **{**FAST, **case["kw"]})
    with open(out / "predictions.csv", newline="") as fh:
        predictions = list(csv.reader(fh))
    metrics = json.loads((out / "metrics.json").read_text())
    metrics.pop("train_seconds")
    meta = json.loads((out / "finetune.json").read_text())
    meta.pop("source"), meta.pop("model")
    return {"predictions": predictions, "metrics": metrics, "meta": meta}


def same(got, want, path="") -> None:
    """Equal, floats to a relative 1e-5 (numbers written as text in predictions.csv too)."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), path
        for k in want:
            same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for k, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{path}[{k}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-9), path
    elif isinstance(want, str) and isinstance(got, str) and got != want:
        try:
            assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-9), path
        except ValueError:
            assert got == want, path
    else:
        assert got == want, path


#: run_case's results from the pre-split code (git HEAD 9b59245, protein_performer/finetune.py), by case
REFERENCE = {'classification': {'meta': {'classes': ['few_K', 'many_K'],
                             'dropout': 0.0,
                             'freeze': 'none',
                             'head_init': 'random',
                             'lora': None,
                             'num_outputs': 2,
                             'pooling': 'mean',
                             'schedule': 'linear',
                             'select_by': 'accuracy',
                             'target_scale': [0.0, 1.0],
                             'task': 'classification',
                             'warmup': 0.06,
                             'window': 0},
                    'metrics': {'accuracy': 0.5,
                                'auroc': 0.625,
                                'baseline': {'accuracy': 0.5},
                                'best_epoch': 2,
                                'best_val_loss': 0.7361517548561096,
                                'epochs': 3,
                                'head_init': 'random',
                                'mcc': 0.0,
                                'n': 8,
                                'probe': {'C': 0.0001, 'examples': 24},
                                'proteins': {'test': 8, 'train': 24, 'valid': 8},
                                'selection': {'by': 'accuracy',
                                              'candidates': [{'accuracy': 0.375,
                                                              'loss': 0.6933630108833313,
                                                              'name': 'probe'},
                                                             {'accuracy': 0.5,
                                                              'loss': 0.9135733842849731,
                                                              'name': 'epoch 1'},
                                                             {'accuracy': 0.5,
                                                              'loss': 0.7361517548561096,
                                                              'name': 'epoch 2'},
                                                             {'accuracy': 0.5,
                                                              'loss': 0.8015901446342468,
                                                              'name': 'epoch 3'}],
                                              'kept': 'epoch 2',
                                              'over_probe': 0.125,
                                              'split': 'valid'},
                                'steps': 6},
                    'predictions': [['id', 'label', 'prediction', 'score'],
                                    ['p0', 'many_K', 'many_K', '0.6104538440704346'],
                                    ['p5', 'few_K', 'many_K', '0.5906723737716675'],
                                    ['p10', 'many_K', 'many_K', '0.5511548519134521'],
                                    ['p15', 'few_K', 'many_K', '0.5507703423500061'],
                                    ['p20', 'many_K', 'many_K', '0.5919036865234375'],
                                    ['p25', 'few_K', 'many_K', '0.5892670154571533'],
                                    ['p30', 'many_K', 'many_K', '0.5634031891822815'],
                                    ['p35', 'few_K', 'many_K', '0.5785646438598633']]},
 'classification_probe': {'meta': {'classes': ['few_K', 'many_K'],
                                   'dropout': 0.0,
                                   'freeze': 'none',
                                   'head_init': 'probe',
                                   'lora': None,
                                   'num_outputs': 2,
                                   'pooling': 'attention',
                                   'schedule': 'linear',
                                   'select_by': 'accuracy',
                                   'target_scale': [0.0, 1.0],
                                   'task': 'classification',
                                   'warmup': 0.06,
                                   'window': 0},
                          'metrics': {'accuracy': 0.625,
                                      'auroc': 0.4375,
                                      'baseline': {'accuracy': 0.5},
                                      'best_epoch': 3,
                                      'best_val_loss': 0.6239956021308899,
                                      'epochs': 3,
                                      'head_init': 'probe',
                                      'mcc': 0.3779644730092272,
                                      'n': 8,
                                      'probe': {'C': 0.0001, 'examples': 24},
                                      'proteins': {'test': 8, 'train': 24, 'valid': 8},
                                      'selection': {'by': 'accuracy',
                                                    'candidates': [{'accuracy': 0.375,
                                                                    'loss': 0.6933630108833313,
                                                                    'name': 'probe'},
                                                                   {'accuracy': 0.5,
                                                                    'loss': 0.686600923538208,
                                                                    'name': 'epoch 1'},
                                                                   {'accuracy': 0.75,
                                                                    'loss': 0.6287988424301147,
                                                                    'name': 'epoch 2'},
                                                                   {'accuracy': 0.75,
                                                                    'loss': 0.6239956021308899,
                                                                    'name': 'epoch 3'}],
                                                    'kept': 'epoch 3',
                                                    'over_probe': 0.375,
                                                    'split': 'valid'},
                                      'steps': 6},
                          'predictions': [['id', 'label', 'prediction', 'score'],
                                          ['p0', 'many_K', 'few_K', '0.31358280777931213'],
                                          ['p5', 'few_K', 'few_K', '0.32520073652267456'],
                                          ['p10', 'many_K', 'few_K', '0.33858105540275574'],
                                          ['p15', 'few_K', 'few_K', '0.4553038775920868'],
                                          ['p20', 'many_K', 'many_K', '0.7209657430648804'],
                                          ['p25', 'few_K', 'few_K', '0.4293007552623749'],
                                          ['p30', 'many_K', 'few_K', '0.24826058745384216'],
                                          ['p35', 'few_K', 'few_K', '0.2591252624988556']]},
 'multiclass_drawn_splits': {'meta': {'classes': ['D', 'K', 'W'],
                                      'dropout': 0.0,
                                      'freeze': 'none',
                                      'head_init': 'random',
                                      'lora': None,
                                      'num_outputs': 3,
                                      'pooling': 'mean',
                                      'schedule': 'constant',
                                      'select_by': 'accuracy',
                                      'target_scale': [0.0, 1.0],
                                      'task': 'classification',
                                      'warmup': 0.06,
                                      'window': 0},
                             'metrics': {'accuracy': 0.125,
                                         'baseline': {'accuracy': 0.0},
                                         'best_epoch': 0,
                                         'best_val_loss': 0.9588400721549988,
                                         'epochs': 3,
                                         'head_init': 'random',
                                         'macro_f1': 0.1111111111111111,
                                         'mcc': 0.0,
                                         'n': 8,
                                         'probe': {'C': 0.01, 'examples': 29},
                                         'proteins': {'test': 8, 'train': 29, 'valid': 3},
                                         'selection': {'by': 'accuracy',
                                                       'candidates': [{'accuracy': 0.6666666666666666,
                                                                       'loss': 0.9588400721549988,
                                                                       'name': 'probe'},
                                                                      {'accuracy': 0.6666666666666666,
                                                                       'loss': 1.1057766675949097,
                                                                       'name': 'epoch 1'},
                                                                      {'accuracy': 0.3333333333333333,
                                                                       'loss': 1.2431010007858276,
                                                                       'name': 'epoch 2'},
                                                                      {'accuracy': 0.3333333333333333,
                                                                       'loss': 0.8789899945259094,
                                                                       'name': 'epoch 3'}],
                                                       'kept': 'probe',
                                                       'over_probe': 0.0,
                                                       'split': 'valid'},
                                         'steps': 6},
                             'predictions': [['id', 'label', 'prediction'], ['p2', 'W', 'D'], ['p11', 'W', 'K'],
                                             ['p17', 'W', 'K'], ['p20', 'W', 'D'], ['p23', 'W', 'K'],
                                             ['p30', 'D', 'D'], ['p32', 'W', 'D'], ['p33', 'D', 'K']]},
 'regression_probe': {'meta': {'classes': [],
                               'dropout': 0.0,
                               'freeze': 'none',
                               'head_init': 'probe',
                               'lora': None,
                               'num_outputs': 1,
                               'pooling': 'mean',
                               'schedule': 'linear',
                               'select_by': 'spearman',
                               'target_scale': [0.098478625, 0.05949299789107714],
                               'task': 'regression',
                               'warmup': 0.06,
                               'window': 0},
                      'metrics': {'baseline': {'rmse': 0.0347573617235885},
                                  'best_epoch': 0,
                                  'best_val_loss': 0.8653740286827087,
                                  'epochs': 3,
                                  'head_init': 'probe',
                                  'n': 8,
                                  'pearson': 0.6780197108950231,
                                  'probe': {'alpha': 1000.0, 'examples': 24},
                                  'proteins': {'test': 8, 'train': 24, 'valid': 8},
                                  'rmse': 0.032331208476852134,
                                  'selection': {'by': 'spearman',
                                                'candidates': [{'loss': 0.8653740286827087,
                                                                'name': 'probe',
                                                                'spearman': 0.8333333333333335},
                                                               {'loss': 1.1060879230499268,
                                                                'name': 'epoch 1',
                                                                'spearman': -0.28571428571428575},
                                                               {'loss': 0.8424608111381531,
                                                                'name': 'epoch 2',
                                                                'spearman': 0.30952380952380953},
                                                               {'loss': 0.8266980648040771,
                                                                'name': 'epoch 3',
                                                                'spearman': 0.4047619047619048}],
                                                'kept': 'probe',
                                                'over_probe': 0.0,
                                                'split': 'valid'},
                                  'spearman': 0.7142857142857144,
                                  'steps': 6},
                      'predictions': [['id', 'label', 'prediction'], ['p0', '0.097626', '0.10035102660099803'],
                                      ['p5', '0.099967', '0.09245335213781108'],
                                      ['p10', '0.167693', '0.10262231595768194'],
                                      ['p15', '0.132433', '0.10459920041425991'],
                                      ['p20', '0.083507', '0.0958459643053981'],
                                      ['p25', '0.095353', '0.09698273330607361'],
                                      ['p30', '0.04351', '0.09600883745508429'],
                                      ['p35', '0.119988', '0.10052965134478851']]},
 'residue': {'meta': {'classes': ['C', 'E', 'H'],
                      'dropout': 0.0,
                      'freeze': 'none',
                      'head_init': 'random',
                      'lora': None,
                      'num_outputs': 3,
                      'pooling': 'mean',
                      'schedule': 'linear',
                      'select_by': 'residue_accuracy',
                      'target_scale': [0.0, 1.0],
                      'task': 'residue',
                      'warmup': 0.06,
                      'window': 2},
             'metrics': {'baseline': {'residue_accuracy': 0.44214876033057854},
                         'best_epoch': 0,
                         'best_val_loss': 1.0770339965820312,
                         'epochs': 3,
                         'head_init': 'random',
                         'n': 8,
                         'probe': {'C': 10.0, 'examples': 761},
                         'proteins': {'test': 8, 'train': 24, 'valid': 8},
                         'q3': 0.5537190082644629,
                         'residues': 242,
                         'selection': {'by': 'residue_accuracy',
                                       'candidates': [{'loss': 1.0770339965820312,
                                                       'name': 'probe',
                                                       'residue_accuracy': 0.5972850678733032},
                                                      {'loss': 1.108359456062317,
                                                       'name': 'epoch 1',
                                                       'residue_accuracy': 0.43891402714932126},
                                                      {'loss': 1.240658164024353,
                                                       'name': 'epoch 2',
                                                       'residue_accuracy': 0.43891402714932126},
                                                      {'loss': 1.1035840511322021,
                                                       'name': 'epoch 3',
                                                       'residue_accuracy': 0.4751131221719457}],
                                       'kept': 'probe',
                                       'over_probe': 0.0,
                                       'split': 'valid'},
                         'steps': 6},
             'predictions': [['id', 'label', 'prediction'],
                             ['p0', 'ECCCEHCECECCCHHCECEHCEHEECEECC', 'EECCECCECECCCCECECECCECEECEEEC'],
                             ['p5', 'EEHEEECCECCCCHCCCCCCCCHHECHHEEE', 'CECEECECEEEEEECEECECCCECECECCEE'],
                             ['p10', 'CCHHCHEEEHHEHECCCEEHEEEEEEHCCEHEC', 'CCHECHEEEHEEEECHHEEEEEEEEEHHEEHEE'],
                             ['p15', 'CHCEECHHCHHEHHEECEEHCHCCCHHECHCECHCHHCHH',
                              'CCCEECCCCHCCHCECCECCCCCHCCCHCCCECCCHCCHH'],
                             ['p20', 'CCCCCHCECCEEHHHEEEHCCCHHCCH', 'CCCCCCCCCCCCCCCCCCCCCCCCCCC'],
                             ['p25', 'ECECCHECHECHECHHCHECCHHC', 'CCECHCCCCECCCCCCCCECCCCC'],
                             ['p30', 'HCCHHECCCHHCCCCCECCHCC', 'HEHHHHHHHHHHHHHHHHCHHE'],
                             ['p35', 'ECCCHEHCCEECCCECCEHHHEECCCCHECCHCEC',
                              'CCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC']]}}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_split_package_gives_the_pre_split_results(name, ckpt, tmp_path):
    same(run_case(ckpt, tmp_path, name), REFERENCE[name], name)


def test_no_function_in_the_finetune_package_is_longer_than_80_lines():
    pkg = ROOT / "protein_performer" / "finetune"
    long = []
    for path in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.name}:{node.lineno} {node.name}: {n} lines")
    assert len(list(pkg.glob("*.py"))) > 3
    assert not long, "\n".join(long)
