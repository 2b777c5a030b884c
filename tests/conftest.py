"""Process-wide test settings: loopback-only Ray, fake CPU devices for JAX.

These must be set before Ray or JAX is imported anywhere, so they live at the top of conftest.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray's temp dir of this test run alone: a job's driver finds its cluster through the temp dir's "current
# cluster" file, which another run's cluster on this machine would otherwise take over.
if "RAY_TMPDIR" not in os.environ:
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="hc-ray-")
    atexit.register(shutil.rmtree, os.environ["RAY_TMPDIR"], ignore_errors=True)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
