"""Every import path users have keeps working, and the package's modules keep their shape.

- every name the documentation uses: each `fastce_torch.<path>` and `from fastce_torch<.module> import <names>` in
  README.md, docs/*.md, CONTRACT.md and examples/ resolves (read from those files at each run);
- the public API (`fastce_torch.__all__`) and the modules users import by path: the compatibility modules
  (fastce_torch.liger, .transformers, .trl, .unsloth, .versions: their names live in integrations/ and core/), the
  engine's documented names at fastce_torch.linear, and `python -m fastce_torch.compile_check`;
- every module of the package (tests excluded) has `__all__`, and every name in it exists;
- no package `__init__` binds a name equal to one of its submodules or subpackages (a function shadowing a module);
- no import cycle among the package's modules.
"""

import ast
import importlib
import pathlib
import pkgutil
import re
import sys

import pytest

import fastce_torch

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = pathlib.Path(fastce_torch.__file__).resolve().parent
DOCUMENTS = ["README.md", "CONTRACT.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
DOCUMENTS += sorted(f"examples/{p.name}" for p in (REPO / "examples").glob("*.py"))

COMPATIBILITY = {
    "fastce_torch.liger": [
        "fastce_torch.integrations.liger",
        "fastce_torch.integrations.liger_jsd",
        "fastce_torch.integrations.liger_grpo",
    ],
    "fastce_torch.transformers": ["fastce_torch.integrations.transformers"],
    "fastce_torch.liger_jsd": ["fastce_torch.integrations.liger_jsd"],
    "fastce_torch.trl": ["fastce_torch.integrations.trl"],
    "fastce_torch.unsloth": ["fastce_torch.integrations.unsloth"],
    "fastce_torch.versions": ["fastce_torch.core.versions"],
}
# Names users reach by these paths today (the documents name some without the path).
USER_PATHS = [
    "fastce_torch.liger.LigerCrossEntropyLoss",
    "fastce_torch.liger.LigerFusedLinearCrossEntropyLoss",
    "fastce_torch.liger.LigerJSD",
    "fastce_torch.liger.LigerFusedLinearJSD",
    "fastce_torch.liger.liger_jsd",
    "fastce_torch.liger.liger_fused_linear_jsd",
    "fastce_torch.liger.FASTCE_OPTIONS",
    "fastce_torch.liger.LigerFusedLinearGRPOLoss",
    "fastce_torch.liger.LigerFusedLinearGRPOFunction",
    "fastce_torch.transformers.patch_transformers",
    "fastce_torch.transformers.fastce_for_causal_lm_loss",
    "fastce_torch.transformers.COMPUTE_THEIR_OWN_LOSS",
    "fastce_torch.trl.patch_trl",
    "fastce_torch.unsloth.fast_cross_entropy_loss",
    "fastce_torch.unsloth.patch_loss_functions",
    "fastce_torch.versions.UntestedReleaseWarning",
    "fastce_torch.versions.warn_if_untested",
    "fastce_torch.linear.DEFAULT_WORKSPACE_BYTES",
    "fastce_torch.linear.ROWS_MULTIPLE",
    "fastce_torch.linear.rows_per_chunk",
    "fastce_torch.compile_check.main",
]

DOTTED = re.compile(r"\bfastce_torch(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FROM_IMPORT = re.compile(r"\bfrom (fastce_torch(?:\.[A-Za-z_][A-Za-z0-9_]*)*) import (?:\(([^)]*)\)|([A-Za-z0-9_, ]+))")


def resolve(path):
    """The object at a dotted path, as Python reaches it: each part an attribute of the one before, or else its
    submodule (a module users import by path, such as fastce_torch.liger)."""
    first, *rest = path.split(".")
    obj, prefix = importlib.import_module(first), first
    for part in rest:
        prefix = f"{prefix}.{part}"
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(prefix)
    return obj


def documented_paths():
    """Every fastce_torch path the documents use (dotted, or a `from ... import` of names)."""
    found = set()
    for name in DOCUMENTS:
        text = (REPO / name).read_text()
        for match in DOTTED.finditer(text):
            path = match.group(0)
            if not path.startswith("fastce_torch.tests."):
                found.add(path)
        for module, parenthesised, names in FROM_IMPORT.findall(text):
            for imported in re.split(r"[,\s]+", parenthesised or names):
                if imported.isidentifier() and imported not in ("as", "import"):
                    found.add(f"{module}.{imported}")
    return sorted(found)


def package_modules():
    """Every module of fastce_torch, tests excluded, imported."""
    names = ["fastce_torch"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="fastce_torch."):
        if ".tests" not in info.name + "." and not info.name.endswith("compile_check"):
            names.append(info.name)
    names.append("fastce_torch.compile_check")
    return {name: importlib.import_module(name) for name in names}


def test_the_documents_name_something():
    paths = documented_paths()
    assert "fastce_torch.cross_entropy" in paths and "fastce_torch.liger.LigerCrossEntropyLoss" in paths, paths


@pytest.mark.parametrize("path", documented_paths())
def test_every_documented_name_resolves(path):
    resolve(path)


@pytest.mark.parametrize("path", USER_PATHS)
def test_user_paths_resolve(path):
    resolve(path)


@pytest.mark.parametrize("name", fastce_torch.__all__)
def test_public_api(name):
    assert getattr(fastce_torch, name) is not None
    assert not isinstance(getattr(fastce_torch, name), type(sys))  # a function or class, never a module


@pytest.mark.parametrize("module, sources", COMPATIBILITY.items())
def test_compatibility_modules_hand_on_every_public_name(module, sources):
    compat = importlib.import_module(module)
    for source in map(importlib.import_module, sources):
        for name in source.__all__:
            assert getattr(compat, name) is getattr(source, name), (module, name)
    assert set(compat.__all__) == {name for source in sources for name in importlib.import_module(source).__all__}


def test_every_module_has_a_valid_all():
    missing, absent = [], []
    for name, module in package_modules().items():
        if not hasattr(module, "__all__"):
            missing.append(name)
            continue
        absent += [f"{name}.{entry}" for entry in module.__all__ if not hasattr(module, entry)]
    assert not missing, f"modules without __all__: {missing}"
    assert not absent, f"__all__ names that do not exist: {absent}"


def test_no_init_binds_a_submodule_name():
    """After every module is imported, each package's attribute of a submodule's name is that submodule (an
    __init__ that bound a function of the same name, as `jsd` once shadowed jsd.py, would leave the function)."""
    modules = package_modules()
    shadowed = []
    for name, module in modules.items():
        if not hasattr(module, "__path__"):
            continue
        for info in pkgutil.iter_modules(module.__path__):
            child = f"{name}.{info.name}"
            if child in modules and getattr(module, info.name) is not modules[child]:
                shadowed.append(child)
    assert not shadowed, f"names bound over submodules: {shadowed}"


def imports_of(path, module_name):
    """The package modules that the module at `path` imports (relative and absolute)."""
    tree = ast.parse(path.read_text())
    package = module_name if path.name == "__init__.py" else module_name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in sys.modules else base)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("fastce_torch") and name != module_name}


def test_no_import_cycle():
    modules = package_modules()
    graph = {
        name: imports_of(pathlib.Path(module.__file__), name) & set(modules)
        for name, module in modules.items()
        if name != "fastce_torch"
    }
    state = {}

    def visit(name, trail):
        state[name] = "open"
        for target in sorted(graph.get(name, ())):
            if state.get(target) == "open":
                raise AssertionError("import cycle: " + " -> ".join([*trail[trail.index(target) :], target]))
            if target not in state:
                visit(target, [*trail, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
