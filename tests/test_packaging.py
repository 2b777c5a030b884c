"""The package installs under one import name, imports from any directory, and its CLI runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _run(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_subpackages_import_from_another_directory(tmp_path):
    code = (
        "import hicache, hicache.cluster, hicache.cluster.tree, hicache.workers, hicache.storage, hicache.kernels;"
        "import hicache.cluster.tree as t; print(t.__file__)"
    )
    res = _run([sys.executable, "-c", code], str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "cluster" in res.stdout


def test_generic_top_level_names_are_not_installed(tmp_path):
    for name in ("cluster", "workers", "storage", "kernels"):
        res = _run([sys.executable, "-c", f"import {name}"], str(tmp_path))
        assert res.returncode != 0, f"'import {name}' must not work outside the repo"


def test_cli_demo_runs_small(tmp_path):
    res = _run([sys.executable, "-m", "hicache", "demo", "--conversations", "3", "--turns", "2"], str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "cold 0" in res.stdout and "L3" in res.stdout
    assert (tmp_path / "hicache-demo.png").stat().st_size > 10_000
    assert (tmp_path / ".hicache" / "l3").is_dir()


def test_cli_rejects_unknown_command(tmp_path):
    res = _run([sys.executable, "-m", "hicache", "frobnicate"], str(tmp_path))
    assert res.returncode == 2 and "invalid choice" in res.stderr


PACKAGE_FOLDERS = ("hicache", "cluster", "workers", "storage", "kernels")
MODULE_DISTS = {"sgl_jax": "sglang-jax", "zmq": "pyzmq"}  # optional imports whose distribution may not be installed here


def _declared() -> dict[str, set[str]]:
    """Distributions pyproject.toml declares: 'core' and one set per extra (names normalized)."""
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}

    return {"core": names(project["dependencies"]),
            **{k: names(v) for k, v in project["optional-dependencies"].items()}}


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level modules the package's source imports, outside the stdlib and hicache: module -> files."""
    import ast
    from pathlib import Path

    root = Path(__file__).parents[1]
    found: dict[str, set[str]] = {}
    for folder in PACKAGE_FOLDERS:
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    top = mod.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "hicache":
                        found.setdefault(top, set()).add(str(path.relative_to(root)))
    return found


def test_every_third_party_import_of_the_package_is_declared():
    from importlib.metadata import packages_distributions

    declared = _declared()
    everything = set().union(*declared.values())
    dists = packages_distributions()
    imports = _third_party_imports()
    assert "numpy" in imports and "jax" in imports  # the scan sees the package
    undeclared = {mod: sorted(files) for mod, files in imports.items()
                  if not {d.lower().replace("_", "-") for d in dists.get(mod, [MODULE_DISTS.get(mod, mod)])} & everything}
    assert not undeclared, f"imported but not in pyproject.toml: {undeclared}"


def test_optional_dependencies_stay_out_of_the_core():
    declared = _declared()
    for dist, extra in (("gcsfs", "gcs"), ("matplotlib", "demo"), ("rich", "demo")):
        assert dist not in declared["core"] and dist in declared[extra] and dist in declared["test"]
    assert "ml-dtypes" in declared["core"]  # workers/spec.py imports it


def test_the_core_imports_and_the_demo_names_its_extra_without_the_optional_deps(tmp_path):
    # As if the extras were not installed: None in sys.modules makes `import X` raise, find_spec says
    # not found.
    code = (
        "import importlib.util, sys\n"
        "OPTIONAL = ('rich', 'matplotlib', 'gcsfs')\n"
        "sys.modules.update(dict.fromkeys(OPTIONAL))\n"
        "find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name in OPTIONAL else find(name, *a)\n"
        "import hicache, hicache.cli, hicache.cluster, hicache.workers, hicache.storage\n"
        "for name in hicache.__all__: getattr(hicache, name)\n"
        "try:\n"
        f"    hicache.load_replica_file({REPLICA_FILE!r})\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "sys.exit(hicache.cli.main(['demo']))\n"
    )
    res = _run([sys.executable, "-c", code], str(tmp_path))
    assert res.returncode == 1, (res.stdout, res.stderr[-2000:])
    assert 'pip install -e ".[demo]"' in res.stderr and "rich, matplotlib" in res.stderr
    assert "gs://my-kv-bucket/hicache' needs gcsfs" in res.stdout and "hicache[gcs]" in res.stdout


REPLICA_FILE = str(Path(__file__).parents[1] / "ray_configs" / "replicas" / "v6e-16.yaml")  # L3 on gs://
