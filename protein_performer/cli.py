"""``protein-performer <command> [key=value ...]``: one console command, a subcommand per job,
taking the same Hydra overrides as ``python scripts/<job>.py`` (the scripts call this).

Start-up is cheap: only Hydra is imported before the job runs, so ``--help`` answers at
once; the job's module (torch, Lightning, wandb) is imported when the job starts.
"""
from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    config: str      # conf/<config>.yaml
    target: str      # "module:function" taking the composed config
    summary: str


COMMANDS = {
    "train": Command("train", "protein_performer.commands:train",
                     "train a protein language model (masked or causal) on the bundled sample, FASTA, .dat or TrEMBL"),
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
    import hydra

    from .errors import cli
    from .resources import conf_dir

    spec = COMMANDS[command]
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("hydra.job.name=") for a in args):
        args.append(f"hydra.job.name={command}")
    sys.argv = [prog or f"protein-performer {command}", *args]
    module, function = spec.target.split(":")

    @hydra.main(config_path=str(conf_dir()), config_name=spec.config, version_base="1.3")
    @cli
    def job(cfg):
        return getattr(importlib.import_module(module), function)(cfg)

    job()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    run(argv[0], argv[1:])


if __name__ == "__main__":
    main()
