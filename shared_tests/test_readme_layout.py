"""README's "Layout" table names every module of both packages in its folder's row (files read, nothing imported):
a module added without its row fails here."""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def layout_rows():
    """{folder ("core/", ..., "" for the top level): the module names in backticks on its row}."""
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        match = re.match(r"\| (?:`([a-z_/]+/)`|top level) \| (.*) \|$", line)
        if match:
            rows[match.group(1) or ""] = set(re.findall(r"`([a-z_0-9]+)`", match.group(2)))
    return rows


@pytest.mark.parametrize("package", ["fastce_torch", "fastce_jax"])
def test_every_module_is_in_its_folders_row(package):
    rows, missing = layout_rows(), []
    root = REPO / package
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "tests" in relative.parts or (path.name == "__init__.py" and len(relative.parts) > 1):
            continue
        folder = "".join(f"{part}/" for part in relative.parts[:-1])  # "" for the top level
        if path.stem not in rows.get(folder, set()):
            missing.append(str(relative))
    assert not missing, f"README's layout table does not name: {missing}"
