"""``import hicache`` is the whole API for serving code: ``__all__`` resolves, stays light, and the
README's serving examples run with that one import."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hicache

REPO = Path(__file__).parents[1]
README = (REPO / "README.md").read_text()


def test_every_name_in_all_resolves_and_dir_lists_it():
    assert len(__all__ := hicache.__all__) == len(set(__all__))
    for name in __all__:
        assert getattr(hicache, name) is not None, name
    assert set(__all__) <= set(dir(hicache))
    with pytest.raises(AttributeError, match="no attribute 'frobnicate'"):
        hicache.frobnicate  # noqa: B018


def test_the_lazy_table_the_type_checking_imports_and_all_agree():
    tree = ast.parse(Path(hicache.__file__).read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                typed.update({a.name: imp.module for a in imp.names})
    assert typed == hicache._LAZY
    assert set(hicache.__all__) == set(hicache._LAZY)


def test_names_come_from_where_the_cache_defines_them():
    from hicache.cluster.client import CacheClient, embedded
    from hicache.cluster.errors import HiCacheError
    from hicache.cluster.tree import RadixKey

    assert hicache.embedded is embedded and hicache.CacheClient is CacheClient
    assert hicache.RadixKey is RadixKey and hicache.HiCacheError is HiCacheError
    assert issubclass(hicache.HiCacheTimeoutError, hicache.HiCacheError)


def test_import_hicache_stays_light():
    code = ("import sys, hicache; hicache.__all__; dir(hicache)\n"
            "print(sorted(m for m in ('ray', 'jax', 'numpy', 'hicache.cluster') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


def _serving_snippets() -> list[str]:
    section = README.split("## Using the cache from serving code", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_serving_examples_use_only_import_hicache():
    snippets = _serving_snippets()
    assert len(snippets) >= 3
    for code in snippets:
        tree = ast.parse(code)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                raise AssertionError(f"README snippet imports from {node.module}: use `import hicache`")
            if isinstance(node, ast.Import):
                assert {a.name for a in node.names} <= {"hicache", "numpy", "tempfile"}, ast.unparse(node)
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "hicache"):
                assert node.attr in hicache.__all__, f"hicache.{node.attr} is not in hicache.__all__"


@pytest.mark.parametrize("index", [0, 1])
def test_readme_embedded_examples_run(index):
    """The embedded examples (L1 only; L1 + L2 + L3 in a temporary directory) run as written; the Ray one
    needs a cluster and is checked by the test above only."""
    code = _serving_snippets()[index]
    assert "hicache.embedded(" in code
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
