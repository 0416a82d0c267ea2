"""The import paths users have keep working, and the package's modules keep their shape: every name the docs and
examples use (README.md, docs/*.md, CONTRACT.md, examples/), the compatibility modules (fastce_jax.versions,
fastce_jax.optax_losses, fastce_jax.unsloth), every name in fastce_jax.__all__; each module has an ``__all__`` whose
names exist, and no package ``__init__`` binds a name equal to one of its submodules (a function shadowing a module)."""

import importlib
import pathlib
import pkgutil
import re

import pytest

import fastce_jax

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTED = [
    "fastce_jax.CrossEntropyOutput",
    "fastce_jax.LogProbOutput",
    "fastce_jax.DEFAULT_WORKSPACE_BYTES",
    "fastce_jax.cross_entropy",
    "fastce_jax.cross_entropy_reference",
    "fastce_jax.fast_cross_entropy_loss",
    "fastce_jax.jsd",
    "fastce_jax.linear_cross_entropy",
    "fastce_jax.linear_jsd",
    "fastce_jax.linear_log_probs",
    "fastce_jax.linear_policy_loss",
    "fastce_jax.linear_token_objective",
    "fastce_jax.PolicyLossOutput",
    "fastce_jax.log_probs",
    "fastce_jax.softmax_cross_entropy_with_integer_labels",
    "fastce_jax.versions.UntestedReleaseWarning",
    "fastce_jax.versions.warn_if_untested",
    "fastce_jax.optax_losses.softmax_cross_entropy_with_integer_labels",
    "fastce_jax.unsloth.fast_cross_entropy_loss",
]
COMPATIBILITY = {
    "fastce_jax.versions": "fastce_jax.core.versions",
    "fastce_jax.optax_losses": "fastce_jax.integrations.optax_losses",
    "fastce_jax.unsloth": "fastce_jax.integrations.unsloth",
}


def resolve(dotted: str):
    """The object at a dotted path reached from ``import fastce_jax`` by attributes (as a user's code reaches it)."""
    obj = fastce_jax
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def documented_paths():
    """Every ``fastce_jax.X...`` path and ``from fastce_jax... import X`` name in the docs and examples."""
    paths = set()
    sources = [REPO / "README.md", REPO / "CONTRACT.md", *(REPO / "docs").glob("*.md")]
    sources += (REPO / "examples").glob("*.py")
    for source in sources:
        if not source.exists():
            continue
        text = source.read_text()
        paths.update(m.rstrip(".") for m in re.findall(r"\bfastce_jax(?:\.[A-Za-z_]\w*)+", text))
        for module, names in re.findall(r"from (fastce_jax[\w.]*) import \(?([\w, \n]+)\)?", text):
            paths.update(f"{module}.{name.strip()}" for name in names.split(",") if name.strip())
    return sorted(paths)


def package_modules():
    """The names of fastce_jax and all its modules, tests excluded."""
    names = ["fastce_jax"]
    for info in pkgutil.walk_packages(fastce_jax.__path__, "fastce_jax."):
        if ".tests" not in info.name:
            names.append(info.name)
    return names


@pytest.mark.parametrize("dotted", DOCUMENTED)
def test_documented_names(dotted):
    assert resolve(dotted) is not None


def test_every_path_in_the_docs_and_examples_resolves():
    paths = documented_paths()
    if not paths:
        pytest.skip("no docs next to the package (an installed copy)")
    for dotted in paths:
        if dotted.endswith((".py", ".md")):  # a file named in prose
            continue
        try:
            resolve(dotted)
        except AttributeError:
            importlib.import_module(dotted)  # a module path written out in full


@pytest.mark.parametrize("old, new", sorted(COMPATIBILITY.items()))
def test_compatibility_modules_hand_on_the_public_names(old, new):
    module, home = importlib.import_module(old), importlib.import_module(new)
    assert module.__all__, old
    for name in module.__all__:
        assert getattr(module, name) is getattr(home, name), (old, name)
    assert resolve(old) is module  # bound on the package after a plain `import fastce_jax`


@pytest.mark.parametrize("name", fastce_jax.__all__)
def test_every_top_level_name(name):
    assert getattr(fastce_jax, name) is not None
    assert not name.startswith("_")


def test_version():
    assert fastce_jax.__version__ == "0.2.0"


@pytest.mark.parametrize("name", package_modules())
def test_every_module_has_all_and_its_names_exist(name):
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it lacks: {missing}"
    assert len(set(module.__all__)) == len(module.__all__), f"{name}.__all__ repeats a name"


@pytest.mark.parametrize("name", [n for n in package_modules() if hasattr(importlib.import_module(n), "__path__")])
def test_no_package_binds_a_submodule_name_to_something_else(name):
    package = importlib.import_module(name)
    for info in pkgutil.iter_modules(package.__path__):
        child = f"{name}.{info.name}"
        # Before and after importing the submodule (its import binds the module, unless __init__ rebinds the name).
        before = getattr(package, info.name, None)
        importlib.import_module(child)
        for bound in (before, getattr(package, info.name)):
            if bound is not None:
                assert getattr(bound, "__name__", None) == child, f"{name}.{info.name} is {bound!r}, not {child}"
