"""mkdocs hooks (mkdocs.yml ``hooks:``): what the site needs before its pages are read.

* The Python API reference (mkdocstrings, griffe) looks modules up on disk by their import path.
  The repository's folders install under ``mnesite`` through setuptools' ``package-dir``
  (``mnesite.rlog`` is ``rlog/``), a mapping griffe does not follow; so the build lays out
  ``build/api/mnesite/`` with links to the real folders, and mkdocs.yml points griffe there.
* The benchmark charts are drawn from the tables of docs/benchmarks/index.md
  (``benchmarks/charts.py``), so a chart never disagrees with its table.
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

REPO = Path(__file__).resolve().parent
API_TREE = REPO / "build" / "api" / "mnesite"


def _lay_out_api_tree() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    package_dirs: dict[str, str] = project["tool"]["setuptools"]["package-dir"]
    API_TREE.mkdir(parents=True, exist_ok=True)
    for package, folder in package_dirs.items():
        if package == "mnesite":
            link, target = API_TREE / "__init__.py", REPO / folder / "__init__.py"
        else:
            link, target = API_TREE / package.split(".", 1)[1], REPO / folder
        if link.is_symlink() or link.exists():
            if link.resolve() == target.resolve():
                continue
            link.unlink()
        link.symlink_to(target)


def _draw_charts() -> None:
    spec = importlib.util.spec_from_file_location("benchmark_charts", REPO / "benchmarks" / "charts.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("benchmarks/charts.py cannot be loaded")
    charts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(charts)
    charts.main([])


@event_priority(100)  # before mkdocstrings reads its paths, which must exist by then
def on_config(config: Any) -> Any:
    _lay_out_api_tree()
    return config


def on_pre_build(config: Any) -> None:
    _draw_charts()
