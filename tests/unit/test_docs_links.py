"""The README and docs/ point at things that exist: every relative link resolves to a file, every repository
path they name in a command (`perf/...`, `scripts/...`, `client/...`, `tests/...`, `docker/...`) exists, and every
`python -m MODULE` they tell a reader to run is importable from the repository root. Moving a script without
updating its pages fails here. Result folders under perf/results keep their historical commands and are not
checked; their index (perf/results/README.md) is."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "perf" / "results" / "README.md",
                ROOT / "docker" / "README.md"])
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PATH = re.compile(r"(?<![\w./-])((?:perf|scripts|client|tests|docker)/[\w./-]*\w\.(?:py|sh))\b")
MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
OLD_NAMES = "perf/results/README.md"  # its table of old script names is history by design


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _pages():
    return [p for p in PAGES if p.exists()]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = [target for target in LINK.findall(page.read_text())
               if "://" not in target and not target.startswith("mailto:")
               and not (page.parent / target).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(page):
    if page.relative_to(ROOT).as_posix() == OLD_NAMES:
        pytest.skip("the results index maps old script names to new commands")
    missing = sorted({p for p in PATH.findall(page.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_m_modules_import(page):
    # The repository root is on sys.path here as under `python -m` from it: pyproject.toml's pytest pythonpath.
    missing = sorted({m for m in MODULE.findall(page.read_text()) if not _importable(m)})
    assert not missing, f"{page.relative_to(ROOT)} tells readers to run modules that do not exist: {missing}"


def test_the_check_finds_a_missing_path(tmp_path):
    assert PATH.findall("run `.venv/bin/python perf/nowhere.py --x`") == ["perf/nowhere.py"]
    assert MODULE.findall(".venv/bin/python -m perf.ab --quick") == ["perf.ab"]
    assert _importable("inflight.engine") and not _importable("inflight.nowhere") and not _importable("nowhere.x")
    assert LINK.findall("[a](docs/x.md#part) and [b](https://example.org)") == ["docs/x.md", "https://example.org"]
