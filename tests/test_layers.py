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
    ("applications", {"evaluate", "embed", "generate", "probe", "compare", "score", "finetune", "convert_esm", "cli", "commands"}),
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
