"""The package installs under one import name, imports from any directory, and its CLI runs."""

from __future__ import annotations

import subprocess
import sys


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
