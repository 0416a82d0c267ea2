"""The import-time check of the installed releases against the tested ranges (fastce_torch/core/versions.py)."""

import warnings

import pytest

from fastce_torch.core import versions


def _outside(name):
    (_, _), (major, minor) = versions.TESTED[name]
    return f"{major}.{minor + 1}.0"


def _inside(name):
    (major, minor), _ = versions.TESTED[name]
    return f"{major}.{minor}.1"


def test_tested_releases_are_quiet():
    installed = {name: _inside(name) for name in versions.TESTED}
    assert versions.untested(installed) == []


def test_local_version_suffixes_and_unknown_versions():
    name = next(iter(versions.TESTED))
    assert versions.major_minor("2.13.0+cpu") == (2, 13)
    assert versions.major_minor("0.12.0.1") == (0, 12)
    assert versions.major_minor("dev") is None
    assert versions.untested({name: None}) == []
    assert versions.untested({name: "dev"}) == []


def test_an_untested_release_warns_once_naming_the_tested_range(monkeypatch):
    monkeypatch.setattr(versions, "warned", False)
    installed = {name: _inside(name) for name in versions.TESTED}
    name = next(iter(versions.TESTED))
    installed[name] = _outside(name)
    with pytest.warns(versions.UntestedReleaseWarning) as caught:
        assert versions.warn_if_untested(installed) == [f"{name} {installed[name]}"]
    message = str(caught[0].message)
    assert f"{name} {installed[name]}" in message
    for tested in versions.TESTED:
        assert versions.tested_range(tested) in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.warn_if_untested(installed)  # the second time: silent


def test_older_releases_warn_too(monkeypatch):
    monkeypatch.setattr(versions, "warned", False)
    name = next(iter(versions.TESTED))
    (major, minor), _ = versions.TESTED[name]
    older = f"{major}.{minor - 1}.0" if minor else f"{major - 1}.99.0"
    with pytest.warns(versions.UntestedReleaseWarning):
        versions.warn_if_untested({name: older})


def test_the_installed_releases_match_what_import_reported(monkeypatch):
    # What this environment has: in every CI job the installed releases are tested ones (the check stays quiet).
    monkeypatch.setattr(versions, "warned", False)
    outside = versions.untested(versions.installed_versions())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.warn_if_untested()
    assert bool(outside) == any(issubclass(w.category, versions.UntestedReleaseWarning) for w in caught)
