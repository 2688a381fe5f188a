"""The list of packages the test run requires (tests/conftest.py) follows pyproject.toml, so a new
dependency that is missing fails the run by name instead of skipping tests."""

import tomllib
from pathlib import Path

from tests.conftest import REQUIRED, missing_packages

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    for sep in "[<>=!~ ;":
        requirement = requirement.split(sep)[0]
    return requirement.strip().lower()


def test_required_list_covers_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["cpu"]
                + project["optional-dependencies"]["dev"]}
    listed = {_name(dist) for _, dist in REQUIRED}
    assert declared - listed == set(), "add these to REQUIRED in tests/conftest.py"


def test_nothing_required_is_missing():
    assert missing_packages() == []
