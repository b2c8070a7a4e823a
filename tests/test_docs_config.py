"""The configuration keys the operator docs name are the ones ``rlog.config`` reads, with its defaults.

Users script and write TOML against these names: a key the docs name and the code does not know is
refused at start (``unknown key [limits]....``), and a default the page states differently from the
code is a surprise in production.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib

import pytest
from mnesite.rlog import config

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(30)

CONFIGURATION = REPO / "docs" / "operations" / "configuration.md"
SECTIONS = {"limits": config.Limits, "rlog": config.Retention, "cluster": config.Timing}


def config_keys() -> set[str]:
    return {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}


def readme_outside_figures() -> str:
    """README.md without its Figures section (a dated reading kept by the benchmarks, not by us)."""
    return re.sub(r"^## Figures\n.*?(?=^## )", "", (REPO / "README.md").read_text(), flags=re.DOTALL | re.MULTILINE)


def test_the_readme_names_only_config_keys_that_exist() -> None:
    named = set(re.findall(r"`([a-z][a-z_]*_(?:max|min|ms))`", readme_outside_figures()))
    assert named, "the README names no limit at all: the pattern above is stale"
    assert named <= config_keys(), sorted(named - config_keys())


def test_the_configuration_page_lists_every_key_with_the_codes_default() -> None:
    block = re.search(r"```toml\n(.*?)```", CONFIGURATION.read_text(), re.DOTALL)
    assert block is not None
    data = tomllib.loads(block.group(1))
    documented = config.parse_config(data)  # the page's example is a valid configuration
    default = config.parse_config({})
    for section, cls in SECTIONS.items():
        listed = set(data.get(section, {})) - {"core_nodes", "initial_cluster_state"}
        assert listed == {f.name for f in dataclasses.fields(cls)}, (
            section,
            sorted(set(map(str, listed)) ^ {f.name for f in dataclasses.fields(cls)}),
        )
    for attribute in ("limits", "retention", "timing"):
        assert getattr(documented, attribute) == getattr(default, attribute)
    assert (documented.synchronous, documented.disk_probe_interval_ms, documented.initial_cluster_state) == (
        default.synchronous,
        default.disk_probe_interval_ms,
        default.initial_cluster_state,
    )


SECURITY = REPO / "docs" / "operations" / "security.md"


def security_keys_in(text: str) -> set[str]:
    """The keys a ``[security]`` example names, a commented-out one included, up to ``[security.roles]``."""
    section = re.split(r"^\s*\[security\].*$", text, maxsplit=1, flags=re.MULTILINE)[1].split("[security.roles]")[0]
    return {*re.findall(r"^\s*(?:# )?([a-z_]+) = ", section, re.MULTILINE), "roles"}


def test_the_security_page_and_the_config_docstring_name_every_security_key() -> None:
    """A ``[security]`` key the code reads and the pages do not name is one nobody finds (follow_key_links)."""
    block = re.search(r"```toml\n(\[security\]\n.*?)```", SECURITY.read_text(), re.DOTALL)
    assert block is not None
    assert security_keys_in(block.group(1)) == set(config.SECURITY_KEYS)
    assert security_keys_in(config.__doc__ or "") == set(config.SECURITY_KEYS)
    assert config.parse_security({"insecure": True}, "/").follow_key_links is False  # the default both state
