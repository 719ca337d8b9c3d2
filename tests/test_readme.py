"""README.md is a one-screen page whose every promise can be checked without running anything:
the repository paths it names exist, the commands and scripts it names are real, its code blocks
are valid Python and bash, it stays short, and its first code block is still the two install
commands CI runs (.ci/run). The docs it links to link on correctly in turn (relative to docs/).
Reads files only: no training, no model, well under a second."""
import ast
import re
import subprocess

import pytest

from conftest import ROOT
from protein_performer.cli import COMMANDS

README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
BLOCKS = [(lang, body) for lang, body in FENCE.findall(TEXT)]
PROSE = FENCE.sub("", TEXT)  # the text outside code blocks
INLINE = re.findall(r"`([^`\n]+)`", PROSE)
LINKS = re.findall(r"\]\(([^)\s]+)\)", PROSE)

#: the repository's own top-level folders: a path starting with one of them names a repo file
TOP = ("docs", "scripts", "conf", "data", "protein_performer", "tests", "benchmarks")
PATH = re.compile(r"(?<![\w./$-])((?:%s)/[\w.*/-]*)" % "|".join(TOP))
ROOT_FILES = re.compile(r"(?<![\w./-])([\w-]+\.(?:txt|toml))\b")  # constraints-cpu.txt, pyproject.toml


def named_paths():
    """Repository paths named in backticks, link targets and code blocks."""
    texts = INLINE + LINKS + [body for _, body in BLOCKS]
    paths = set()
    for text in texts:
        paths |= {m.rstrip(".,:;") for m in PATH.findall(text)}
        paths |= set(ROOT_FILES.findall(text))
    return sorted(paths)


def command_texts():
    """Where a command can be named: the code blocks and the inline code spans."""
    return [body for _, body in BLOCKS] + INLINE


def test_readme_names_repository_paths_that_exist():
    paths = named_paths()
    assert "scripts/train.py" in paths and "docs/results.md" in paths and "constraints-cpu.txt" in paths
    missing = [p for p in paths if not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert not missing, f"README names paths that do not exist: {missing}"


def test_readme_links_resolve():
    local = [t.split("#")[0] for t in LINKS if "://" not in t and not t.startswith("#")]
    assert len(local) >= 10
    assert not [t for t in local if not (ROOT / t).exists()]


def test_readme_commands_and_scripts_exist():
    commands, scripts = set(), set()
    start = r"(?:^|[;&|`(]\s*|\s)"  # a command word, not part of a path (cd protein-performer)
    for text in command_texts():
        for line in text.splitlines():
            line = line.split(" #")[0]
            commands |= set(re.findall(r"(?:^|[;&|(]\s*)protein-performer[ \t]+([A-Za-z][\w-]*)", line.strip()))
            scripts |= set(re.findall(start + r"python3? (scripts/[\w-]+\.py)", line))
    assert {"train", "embed", "score", "finetune"} <= commands, commands
    assert "scripts/train.py" in scripts
    assert not commands - set(COMMANDS), f"no such protein-performer command: {commands - set(COMMANDS)}"
    assert not [s for s in scripts if not (ROOT / s).is_file()]
    for name, spec in COMMANDS.items():  # each named command has its script (python scripts/<x>.py = the command)
        if name in commands:
            assert (ROOT / "scripts" / f"{spec.config}.py").is_file(), name


def test_readme_code_blocks_are_valid():
    python = [b for lang, b in BLOCKS if lang == "python"]
    bash = [b for lang, b in BLOCKS if lang in ("bash", "sh", "shell")]
    assert python and bash
    assert {lang for lang, _ in BLOCKS} <= {"python", "bash"}, "every code block says its language"
    for code in python:
        ast.parse(code)
    for code in bash:
        r = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, f"{r.stderr}\n{code}"


def test_readme_python_example_uses_the_public_api():
    """The example's imports and calls name what the package defines (it is not run here: it needs
    a trained checkpoint; the calls it makes are tested in test_embed.py and test_score.py)."""
    import protein_performer
    from protein_performer.hub import load
    from protein_performer import score
    (code,) = [b for lang, b in BLOCKS if lang == "python"]
    tree = ast.parse(code)
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert names <= {"load_model", "Scorer"} and hasattr(load, "load_model") and hasattr(score, "Scorer")
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert {"embed_sequences", "masked", "ids", "aa_id"} <= attrs
    assert callable(protein_performer.embed_sequences) and callable(protein_performer.load_pretrained)
    assert all(hasattr(score.Scorer, a) for a in ("masked", "ids", "aa_id"))
    assert len(code.strip().splitlines()) <= 12


def test_readme_fits_one_screen():
    assert len(TEXT.splitlines()) <= 200


def test_first_code_block_is_the_two_install_commands():
    lang, body = BLOCKS[0]
    assert lang == "bash"
    commands = [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    assert all("pip install" in c for c in commands)
    train, test = commands
    assert "scripts/train.py" in train and "pytest" not in train
    assert test.rstrip().endswith("pytest -q -n 2") and "scripts/train.py" not in test  # 2 processes (pytest-xdist)
    # CI runs the README's test command (.ci/run, quietly)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert [line.replace("pip install -q ", "pip install ") for line in ci] == [test]


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_docs_links_resolve(doc):
    """Relative links inside docs/ (the README's moved sections among them) resolve from docs/."""
    text = FENCE.sub("", (ROOT / "docs" / doc).read_text(encoding="utf-8"))
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)]
    broken = [t for t in targets if t and "://" not in t and not t.startswith("mailto:")
              and not (ROOT / "docs" / t).exists()]
    assert not broken, f"docs/{doc}: broken links {broken}"
