"""sgl-jax's own host-pool tests pass against hicache's host pool (``hicache.sgl_jax.pytest_plugin``).

Runs sgl-jax's ``test_host_kv_pool.py``, ``test_hicache_controller.py`` and ``test_hicache_e2e.py`` with the
plugin in a pytest subprocess (one device, as those tests expect), beside ``sgl_jax_plugin_probe.py``, which
checks the class they used was hicache's adapter. The tests the plugin skips must be exactly the ones its
docstring lists. sgl-jax installs its tests with its package (``sgl_jax/test/mem_cache/``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from support.sgl_jax_env import single_device_env

from hicache.sgl_jax.pytest_plugin import PRIVATE_ATTRIBUTE_TESTS

FILES = ("test_host_kv_pool.py", "test_hicache_controller.py", "test_hicache_e2e.py")
PROBE = Path(__file__).with_name("sgl_jax_plugin_probe.py")


def sgl_jax_test_dir() -> Path:
    import sgl_jax

    folder = Path(sgl_jax.__file__).parent / "test" / "mem_cache"
    missing = [name for name in FILES if not (folder / name).is_file()]
    if missing:
        pytest.skip(f"this sgl-jax install has no {missing} in {folder}")
    return folder


def run_with_plugin(folder: Path, tmp_path: Path) -> tuple[dict[str, str], subprocess.CompletedProcess]:
    """Each test's outcome (passed / skipped / failure / error) by ``file.py::Class::test`` (the probe's by
    ``probe::test``), from a pytest subprocess rooted at sgl-jax's test folder."""
    shutil.copy(PROBE, tmp_path / PROBE.name)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.xml"
    command = [sys.executable, "-m", "pytest", "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(folder),
               "-p", "hicache.sgl_jax.pytest_plugin", "-p", "no:cacheprovider", f"--junitxml={report}",
               *(str(folder / name) for name in FILES), str(tmp_path / PROBE.name)]
    with single_device_env():
        done = subprocess.run(command, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True,
                              timeout=600)
    assert report.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        if module:
            key = f"{module}.py::{cls}::{case.get('name')}"
        else:  # the probe, outside the rootdir: an empty or a bare module classname
            key = f"probe::{case.get('name')}"
        tags = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[key] = tags[0] if tags else "passed"
    return outcomes, done


def test_sgl_jax_host_pool_tests_pass_on_hicache_host_pool(tmp_path: Path) -> None:
    folder = sgl_jax_test_dir()
    outcomes, done = run_with_plugin(folder, tmp_path)
    failed = {k: v for k, v in outcomes.items() if v in ("failure", "error")}
    assert not failed and done.returncode == 0, f"{failed}\n{done.stdout[-3000:]}"
    # the probe ran after sgl-jax's tests were collected: the class they named was hicache's
    assert outcomes["probe::test_sgl_jax_names_hicache_host_pool"] == "passed"
    assert outcomes["probe::test_sgl_jax_init_hicache_builds_hicache_host_pool"] == "passed"
    assert {k for k, v in outcomes.items() if v == "skipped"} == set(PRIVATE_ATTRIBUTE_TESTS)
    passed_by_file = {name: sum(k.startswith(name) and v == "passed" for k, v in outcomes.items()) for name in FILES}
    assert all(n > 0 for n in passed_by_file.values()), passed_by_file
