"""The folders show the layers (docs/layout.md): a module imports protein_performer modules
only from its own layer or the layers below, checked on the source (imports inside
functions included), so a change to a lower layer never needs a higher one."""
import ast

from conftest import ROOT

LAYERS = [  # lowest first
    ("core", {"errors", "tokenizer", "formats", "attention", "model", "objectives", "device", "sequences", "resources", "files", "output_guard", "allocator"}),
    ("data", {"data"}),
    ("training", {"training"}),
    ("hub", {"hub"}),
    ("applications", {"evaluate", "embed", "generate", "probe", "probe_solver", "compare", "score", "finetune", "convert_esm", "cli", "commands"}),
]


def layer_of(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    for i, (_, names) in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: not assigned to a layer in tests/test_layers.py (add it to LAYERS)")


def imports(path, module: str) -> set[str]:
    out = set()
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target + "." + a.name for a in node.names] if not node.module else [target]
            out |= {n for n in names if n.startswith("protein_performer.")}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("protein_performer.")}
    return out


def test_no_module_imports_a_higher_layer():
    pkg = ROOT / "protein_performer"
    bad = []
    checked = 0
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if "hf_code" in rel.parts or rel.parts == ("protein_performer", "__init__"):
            continue  # code written into exported model directories; the lazy package facade
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        own = layer_of(module)
        checked += 1
        for target in imports(path, module):
            if target.count(".") and layer_of(target) > own:
                bad.append(f"{module} ({LAYERS[own][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert checked > 30
    assert not bad, "\n".join(bad)


#: The application modules (a module or a package: ``finetune`` either way), training/ and data/,
#: and hub/ between them: each names the others it may import (core it always may). Anything else
#: fails, an application importing another or training importing data included: move the shared
#: piece down a layer (as ``precision_dtype`` went from embed to device.py), or list it here with
#: the reason it belongs.
ALLOWED = {
    "data": set(),
    # training gets its data module from the config (hydra.utils.instantiate), never by import:
    # it runs on any data module, and a change to data/ never needs training/
    "training": set(),
    # load_model and export open a Lightning checkpoint through training.task.load_checkpoint
    "hub": {"training"},
    "evaluate": {"data", "training", "hub"},
    "embed": {"data", "training", "hub"},
    "score": {"data", "training", "hub"},
    "generate": {"hub"},
    "convert_esm": {"hub"},
    # probe's logistic regression (its solver picked by the data's shape) stands apart so that importing
    # probe does not import scikit-learn: make_probe imports it when it builds a probe
    "probe": {"probe_solver"},
    "probe_solver": set(),
    # compare is train-then-evaluate for several models: it runs evaluate itself, whose metrics and
    # table it reports side by side (a copy of evaluate would drift from what evaluate prints)
    "compare": {"training", "evaluate"},
    # finetune builds on probe: its head starts from a linear probe (make_probe), and it reads and
    # checks labels as probe does (one label format for both commands)
    "finetune": {"data", "training", "hub", "probe"},
}
#: the command layer: parses arguments and dispatches, so it may import every application
COMMANDS = {"cli", "commands"}


def unit_edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the modules that import it, for every import between
    two different units of :data:`ALLOWED`."""
    pkg = ROOT / "protein_performer"
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if "hf_code" in rel.parts or len(rel.parts) < 2 or rel.parts[1] not in ALLOWED:
            continue
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for target in imports(path, module):
            unit = target.split(".")[1]
            if unit in ALLOWED and unit != rel.parts[1]:
                edges.setdefault((rel.parts[1], unit), []).append(f"{module} imports {target}")
    return edges


def test_applications_training_and_data_import_only_what_allowed_names():
    edges = unit_edges()
    assert ("hub", "training") in edges and ("embed", "hub") in edges  # the scan sees imports
    bad = [line for (src, dst), lines in sorted(edges.items()) if dst not in ALLOWED[src] for line in lines]
    assert not bad, ("an import between applications, training/ and data/ that tests/test_layers.py "
                     "ALLOWED does not name (move the shared piece down a layer, or add it there with "
                     "why):\n" + "\n".join(bad))


def test_allowed_names_only_imports_that_exist():
    """A stale entry would let a new import of that kind in unseen: drop it when the import goes."""
    edges = unit_edges()
    stale = sorted(f"{src} -> {dst}" for src, dsts in ALLOWED.items() for dst in dsts if (src, dst) not in edges)
    assert not stale, f"ALLOWED in tests/test_layers.py names imports no module makes; remove them: {stale}"


def test_allowed_covers_every_application():
    apps = next(names for name, names in LAYERS if name == "applications")
    assert apps - COMMANDS == set(ALLOWED) - {"data", "training", "hub"}, \
        "a new application module: add it to ALLOWED in tests/test_layers.py with what it may import"


def test_every_name_in_layers_is_a_module_or_package():
    pkg = ROOT / "protein_performer"
    missing = [n for _, names in LAYERS for n in sorted(names)
               if not (pkg / f"{n}.py").is_file() and not (pkg / n / "__init__.py").is_file()]
    assert not missing, f"LAYERS names modules that do not exist: {missing}"


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists the packages by hand (conf/ and data/ are mapped into the package): a new
    folder under protein_performer/ left out of the list imports here and fails in an installed copy."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    pkg = ROOT / "protein_performer"
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in pkg.rglob("__init__.py")}
    assert "protein_performer.attention" in found
    assert not found - listed, f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"


def test_no_public_function_name_is_defined_in_two_modules():
    """One home per concept (issue 43): two top-level functions of one public name are either one
    piece of logic kept twice (keep one, import it) or two things a reader would confuse (rename one).
    The command layer (cli.py, commands.py) names its commands after the applications, so is left out;
    so is hf_code/, which is shipped into exported folders and must stand alone."""
    homes: dict[str, list[str]] = {}
    for path in sorted((ROOT / "protein_performer").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if "hf_code" in rel.parts or rel.with_suffix("").name in COMMANDS and len(rel.parts) == 2:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                homes.setdefault(node.name, []).append(str(rel))
    twice = {name: where for name, where in homes.items() if len(where) > 1}
    assert not twice, f"public functions defined in two modules: {twice}"


def test_no_function_in_the_package_is_longer_than_80_lines():
    """Issue 43: a function a reader can hold in one screen (split into named steps beyond that)."""
    pkg = ROOT / "protein_performer"
    long = [f"{p.relative_to(pkg.parent)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in sorted(pkg.rglob("*.py")) for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, long
