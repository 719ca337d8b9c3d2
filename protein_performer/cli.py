"""``protein-performer <command> [key=value ...]``: one console command, a subcommand per job,
taking the same Hydra overrides as ``python scripts/<job>.py`` (the scripts call this).

Start-up is cheap: only Hydra is imported before the job runs, so ``--help`` answers at
once; the job's module (torch, Lightning, wandb) is imported when the job starts.

The config is composed once before ``hydra.main`` runs, so Hydra's own errors (a key typo,
an unknown group option, a bad override) are one ``error:`` line with exit status 2 like
every other error, and nothing is written yet. That composition also fixes the run folder
(``hydra.run.dir``, handed on to ``hydra.main``), which a training run checks and records
before Hydra writes into it (:func:`protein_performer.training.run_folder.open_run_folder`); Hydra's
flags (``--help``, ``--cfg``, ``-m``, ...) go to Hydra unchanged.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import NamedTuple


#: the command line (before the overrides) that runs the current command again: Lightning's DDP
#: starts the other processes with it (``embed trainer.devices=N``; training sets it itself)
RERUN: list[str] = []


class Command(NamedTuple):
    config: str      # conf/<config>.yaml
    target: str      # "module:function" taking the composed config
    summary: str
    run_folder: bool = False  # a training run folder: checked and recorded before Hydra writes into it


COMMANDS = {
    "train": Command("train", "protein_performer.commands:train",
                     "train a protein language model (masked or causal) on the bundled sample, FASTA, .dat or TrEMBL",
                     run_folder=True),
    "prepare": Command("prepare_data", "protein_performer.commands:prepare",
                       "download and prepare a FASTA / UniProt .dat file into memory-mapped token shards"),
    "evaluate": Command("evaluate", "protein_performer.commands:evaluate",
                        "perplexity and accuracy of checkpoints on held-out proteins, by length"),
    "embed": Command("embed", "protein_performer.commands:embed",
                     "embed a FASTA / .dat / CSV file into HDF5 or ESM-style .pt files"),
    "probe": Command("probe", "protein_performer.commands:probe",
                     "fit a linear probe (scikit-learn) on embeddings against labels"),
    "generate": Command("generate", "protein_performer.commands:generate",
                        "sample proteins from a causal model in RNN mode"),
    "compare": Command("compare", "protein_performer.commands:compare",
                       "train several attention kernels alike and compare them on held-out proteins"),
    "export": Command("export", "protein_performer.commands:export",
                      "write a checkpoint as a Hugging Face-style directory (config.json, model.safetensors)"),
    "score": Command("score", "protein_performer.commands:score",
                     "zero-shot variant effects: score a ProteinGym-style substitution CSV (or a folder of them)"),
    "convert-esm": Command("convert_esm", "protein_performer.commands:convert_esm",
                           "convert ESM-2 (transformers directory or fair-esm .pt) to an exported directory"),
    "finetune": Command("finetune", "protein_performer.commands:finetune",
                        "fine-tune a supervised head (per protein or per residue) on a checkpoint, with test metrics"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: protein-performer <command> [key=value ...] [--help]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {c.summary}" for name, c in COMMANDS.items()]
    lines += ["", "Each command takes Hydra overrides (key=value); `protein-performer <command> --help` lists its keys."]
    return "\n".join(lines)


def run(command: str, argv: list[str] | None = None, prog: str | None = None) -> None:
    """Compose conf/<config>.yaml with ``argv`` (Hydra overrides and flags) and run the job;
    ``prog`` is how messages name the command (default ``protein-performer <command>``)."""
    import contextlib

    import hydra

    from .errors import USER_ERRORS, cli, fail, one_line
    from .resources import conf_dir

    spec = COMMANDS[command]
    global RERUN
    program = RERUN = [sys.argv[0], *([] if argv is None else [command])]  # what runs this command again (DDP)
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("hydra.job.name=") for a in args):
        args.insert(0, f"hydra.job.name={command}")  # before any flag: Hydra reads overrides up to the first
    sys.argv = [prog or f"protein-performer {command}", *args]
    module, function = spec.target.split(":")
    folder = run_dir = None
    if not any(a.startswith("-") for a in args):
        try:
            cfg = compose(spec.config, args)
            check_booleans(spec.config, args, cfg)
            run_dir = str(cfg.hydra.run.dir)
        except USER_ERRORS as e:
            fail(one_line(e))
        except Exception:  # a run dir that only Hydra's own run can resolve: left to it
            run_dir = None
    if run_dir is not None:
        try:
            sys.argv = [sys.argv[0], *(a for a in args if not a.startswith("hydra.run.dir=")),
                        f"hydra.run.dir={quote(run_dir)}"]  # ${now:...} as composed here, not a second later
            from .training.run_folder import check_folder_path, open_run_folder
            check_folder_path(run_dir, "hydra.run.dir")  # Hydra creates it for every command
            if spec.run_folder and os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("RANK", "0") == "0":
                # (the other ranks of a DDP run are launched once rank zero checked and trains)
                from .training.run_folder import run_inputs
                folder = open_run_folder(run_dir, cfg.hydra.job.name, cfg.get("ckpt_path"),
                                         bool(cfg.get("overwrite")), inputs=run_inputs(cfg))
                if folder.hydra_dir != ".hydra" and not any(a.startswith("hydra.output_subdir=") for a in args):
                    sys.argv.append(f"hydra.output_subdir={folder.hydra_dir}")  # the old .hydra/ until success
            elif not spec.run_folder and os.path.abspath(run_dir) != os.getcwd():
                folder = HydraFolder(run_dir, str(cfg.hydra.job.name))  # compare's: Hydra's files go on an error
        except USER_ERRORS as e:
            fail(one_line(e))

    @hydra.main(config_path=str(conf_dir()), config_name=spec.config, version_base="1.3")
    @cli
    def job(cfg):
        if spec.run_folder:  # Lightning's DDP launches the other ranks with sys.argv: the same run folder
            sys.argv = [*program, *sys.argv[1:]]
        with folder.running() if folder else contextlib.nullcontext():
            return getattr(importlib.import_module(module), function)(cfg)

    job()


class HydraFolder:
    """The folder Hydra creates for a command that is not a training run (compare's ``outputs/compare``):
    after a user error, what this invocation created there (the folders, ``.hydra/``, ``<job>.log``)
    is removed when the folder holds nothing else; a folder holding more keeps everything."""

    def __init__(self, run_dir: str, job_name: str):
        from pathlib import Path
        d = Path(run_dir).absolute()
        self.dir = d
        files = [d / ".hydra", *(d / ".hydra" / f"{n}.yaml" for n in ("config", "hydra", "overrides")),
                 d / f"{job_name}.log"]
        self.created = [p for p in [*[p for p in (d, *d.parents) if not p.exists()][::-1], *files] if not p.exists()]

    @contextlib.contextmanager
    def running(self):
        from .errors import user_error
        try:
            yield
        except Exception as e:
            if user_error(e) is not None and self.dir in self.created:
                self.discard()
            raise

    def discard(self) -> None:
        mine = set(self.created)
        if any(p not in mine for p in self.dir.rglob("*")):
            return  # the command wrote more: keep it all
        for p in reversed(self.created):
            with contextlib.suppress(OSError):
                p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()


def compose(config: str, args: list[str]):
    """The config ``hydra.main`` will compose (with ``hydra``), Hydra's errors as one-line UserErrors."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .resources import conf_dir
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return hydra_compose(config, overrides=args, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        from .errors import UserError
        raise UserError(hydra_message(e, config, args)) from None


#: keys whose values their library checks itself (Lightning's ``trainer.deterministic=warn``, wandb's
#: ``logger.log_model=all``): left out of :func:`check_booleans`
LIBRARY_KEYS = ("hydra.", "trainer.", "logger.")


def check_booleans(config: str, args: list[str], cfg) -> None:
    """A key whose default is true or false, given another value: one line (``overwrite=nope`` would
    otherwise read as true). The defaults come from the config composed without the overrides that
    set a key to a string (one more composition, only when there are such overrides)."""
    from omegaconf import OmegaConf

    from .errors import UserError

    def value(c, key):
        try:
            return OmegaConf.select(c, key, default=None, throw_on_missing=False)
        except Exception:  # an interpolation only Hydra's run resolves: not a boolean key
            return None
    given = {}
    for a in args:
        key, eq, _ = a.partition("=")
        if not eq or a.startswith(("+", "~", "-")) or "@" in key or key.startswith(LIBRARY_KEYS):
            continue
        v = value(cfg, key)
        if v is not None and not isinstance(v, bool) and not OmegaConf.is_config(v):
            given[a] = (key, v)
    if not given:
        return
    defaults = compose(config, [a for a in args if a not in given])
    for a, (key, v) in given.items():
        if isinstance(value(defaults, key), bool):
            raise UserError(f"{a}: {key} is true or false, not {v!r}")


def hydra_message(e: BaseException, config: str, args: list[str]) -> str:
    """One line for what Hydra raised while composing: the override, what is wrong, what would work."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from .errors import composition_message

    if isinstance(e.__cause__, (ConfigAttributeError, ConfigKeyError)) and getattr(e.__cause__, "full_key", None):
        key = e.__cause__.full_key
        arg = next((a for a in args if a.split("=", 1)[0] == key), key)
        hint = did_you_mean(key, config, [a for a in args if a != arg])
        return f"{arg}: no key {key} in the {config} config{hint} (add a new key with +{arg})"
    return composition_message(e)


def did_you_mean(key: str, config: str, args: list[str]) -> str:
    """`` (did you mean trainer.max_steps?)`` from the keys beside ``key`` in the composed config."""
    import difflib

    from omegaconf import OmegaConf
    parent, _, leaf = key.rpartition(".")
    try:
        cfg = compose(config, args)
        node = OmegaConf.select(cfg, parent) if parent else cfg
        keys = [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []
    except Exception:  # only a hint: the message stands without it
        return ""
    close = difflib.get_close_matches(leaf, keys, n=1)
    return f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""


def quote(value: str) -> str:
    """``value`` as a Hydra override value (quoted where the override grammar would read it)."""
    if all(c.isalnum() or c in "/._-:+~@" for c in value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        import difflib
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"error: unknown command {argv[0]!r}{hint}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    run(argv[0], argv[1:])


if __name__ == "__main__":
    main()
