"""ray_configs/: every file parses; every cluster config passes Ray's own launcher validation.

GCP configs go through the same steps as `ray up` (``commands._bootstrap_config``) up to, and not
including, the provider's ``bootstrap_config`` (that one talks to the GCP APIs):
``prepare_config`` (defaults merge, setup-command merge, min/max fill) ->
``GCPNodeProvider.fillout_available_node_types_resources`` -> ``validate_config`` (Ray's JSON
schema + its cross-field checks), plus Ray's TPU node checks (``get_node_type`` ->
``_validate_tpu_config``) and its per-host resource rewrite (``_maybe_remove_head_resource``).
Ray's GCP modules import googleapiclient/httplib2 at module level; where those are not installed
they are imported against stubs whose every client constructor raises, so nothing can reach GCP.

The fake multi-node config is checked the way the monitor reads it (raw file, ``validate_config``),
its provider is built (no process is started) and Ray's ``ResourceDemandScheduler`` decides
what to launch. runtime_env files go through what `ray job submit --runtime-env` does
(``parse_runtime_env_args``) and ``RuntimeEnv`` validation; working_dir goes through the job
client's ``upload_working_dir_if_needed`` with the upload recorded instead of sent.
No Ray cluster, no network, no GCP credentials.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import re
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import ray
import yaml
from ray._private import ray_constants
from ray._private.accelerators import tpu as ray_tpu
from ray.autoscaler._private import util as autoscaler_util

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "ray_configs"
RUNTIME_ENVS = CONFIGS / "runtime_env"

EXPECTED_TPU = {
    "tpu-v5e-16.yaml": "v5litepod-16",
    "tpu-v6e-16.yaml": "v6e-16",
    "tpu-v5p-16.yaml": "v5p-16",
}
# TPU VM software versions per generation (GCP "TPU software versions" table).
RUNTIME_VERSIONS = {
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v6e": "v2-alpha-tpuv6e",
    "v5p": "v2-alpha-tpuv5",
}
LOCAL = "local-fake.yaml"
HOST_RESOURCE = "hicache_host"
HEAD_RESOURCE = "hicache_head"
GCS_SCOPES = {
    "https://www.googleapis.com/auth/devstorage.read_write",
    "https://www.googleapis.com/auth/devstorage.full_control",
    "https://www.googleapis.com/auth/cloud-platform",
}
TOKEN_FILE = "~/.ray/auth_token"


def _load(path: Path):
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


def _all_files() -> list[Path]:
    return sorted(p for p in CONFIGS.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))


def _cluster_configs() -> list[Path]:
    return [p for p in _all_files() if isinstance(_load(p), dict) and "provider" in _load(p)]


def _gcp_configs() -> list[Path]:
    return [p for p in _cluster_configs() if _load(p)["provider"].get("type") == "gcp"]


def _runtime_envs() -> list[Path]:
    return sorted(p for p in RUNTIME_ENVS.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))


def _ids(paths):
    return [str(p.relative_to(CONFIGS)) for p in paths]


# ---------------------------------------------------------------- Ray's GCP modules, offline


def _stub_gcp_client_libs() -> None:
    """Stand-ins for the GCP client libraries Ray's GCP modules import at module level."""

    def _no_network(*args, **kwargs):
        raise RuntimeError("GCP API access is disabled in tests")

    httplib2 = types.ModuleType("httplib2")
    httplib2.Http = _no_network
    auth = types.ModuleType("google_auth_httplib2")
    auth.AuthorizedHttp = _no_network
    api = types.ModuleType("googleapiclient")
    discovery = types.ModuleType("googleapiclient.discovery")
    discovery.Resource = type("Resource", (), {})
    discovery.build = _no_network
    errors = types.ModuleType("googleapiclient.errors")
    errors.HttpError = type("HttpError", (Exception,), {})
    api.discovery, api.errors = discovery, errors
    for mod in (httplib2, auth, api, discovery, errors):
        sys.modules[mod.__name__] = mod


@contextlib.contextmanager
def _isolated_imports():
    """Whatever gets imported inside is dropped from sys.modules afterwards (stubs included)."""
    before = set(sys.modules)
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            mod = sys.modules.pop(name)
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and getattr(sys.modules[parent], child, None) is mod:
                delattr(sys.modules[parent], child)


@pytest.fixture(scope="module")
def gcp():
    """Ray's GCP provider helpers; no client is ever constructed (bootstrap_gcp is not called)."""
    with _isolated_imports():
        try:
            importlib.import_module("googleapiclient.discovery")
            importlib.import_module("google_auth_httplib2")
        except ImportError:
            _stub_gcp_client_libs()
        ns = types.SimpleNamespace(
            config=importlib.import_module("ray.autoscaler._private.gcp.config"),
            node=importlib.import_module("ray.autoscaler._private.gcp.node"),
            provider=importlib.import_module("ray.autoscaler._private.gcp.node_provider"),
            tpu_runner=importlib.import_module("ray.autoscaler._private.gcp.tpu_command_runner"),
        )
    return ns


def _ray_up_offline(raw: dict, gcp) -> dict:
    """`ray up`'s config resolution (commands._bootstrap_config) minus the GCP API calls."""
    config = autoscaler_util.prepare_config(copy.deepcopy(raw))
    config = gcp.provider.GCPNodeProvider.fillout_available_node_types_resources(config)
    autoscaler_util.validate_config(config)
    return config


def _tpu_node_type(config: dict, gcp) -> tuple[str, dict]:
    tpu_types = [
        (name, nt)
        for name, nt in config["available_node_types"].items()
        if gcp.config.get_node_type(nt["node_config"]) == gcp.node.GCPNodeType.TPU
    ]
    assert len(tpu_types) == 1, f"expected exactly one TPU slice node type, got {tpu_types}"
    return tpu_types[0]


def _start_commands(config: dict) -> list[str]:
    return list(config["head_start_ray_commands"]) + list(config["worker_start_ray_commands"])


# ---------------------------------------------------------------- every file


def test_expected_files_exist():
    runtime_envs = ["runtime_env/tpu.yaml", "runtime_env/local.yaml"]
    for name in [*EXPECTED_TPU, LOCAL, "README.md", *runtime_envs]:
        assert (CONFIGS / name).is_file(), name
    assert {p.name for p in _gcp_configs()} >= set(EXPECTED_TPU)


@pytest.mark.parametrize("path", _all_files(), ids=_ids(_all_files()))
def test_every_file_parses(path):
    data = _load(path)
    assert isinstance(data, dict) and data, f"{path}: empty or not a mapping"


@pytest.mark.parametrize("path", _all_files(), ids=_ids(_all_files()))
def test_token_auth_never_disabled(path):
    text = path.read_text()
    assert not re.search(r"RAY_AUTH_MODE\W*[=:]\W*disabled", text, re.I), path


def test_readme_names_every_file():
    readme = (CONFIGS / "README.md").read_text()
    for path in [*_cluster_configs(), *_runtime_envs()]:
        assert str(path.relative_to(CONFIGS)) in readme, f"README does not mention {path.name}"


# ---------------------------------------------------------------- TPU slice configs (GCP)


@pytest.mark.parametrize("path", _gcp_configs(), ids=_ids(_gcp_configs()))
def test_gcp_config_resolves_like_ray_up(path, gcp):
    raw = _load(path)
    config = _ray_up_offline(raw, gcp)
    provider = config["provider"]
    assert "project_id" in provider, "provider.project_id must be present (filled in by the user)"
    assert provider["availability_zone"].startswith(provider["region"] + "-")
    # The head is a Compute Engine VM: Ray refuses TPU heads in pods, and the CacheHead lives there.
    head = config["available_node_types"][config["head_node_type"]]
    assert gcp.config.get_node_type(head["node_config"]) == gcp.node.GCPNodeType.COMPUTE
    assert gcp.config._has_tpus_in_node_configs(config)
    assert head["resources"].get(HEAD_RESOURCE) == 1
    # Defaults merged by prepare_config must not smuggle in Ray's example setup (wheel installs).
    assert "ray-wheels" not in json.dumps(config)


@pytest.mark.parametrize("path", _gcp_configs(), ids=_ids(_gcp_configs()))
def test_tpu_slice_is_static_and_sized_per_host(path, gcp):
    config = _ray_up_offline(_load(path), gcp)
    name, node_type = _tpu_node_type(config, gcp)
    accel = node_type["node_config"]["acceleratorType"]
    if path.name in EXPECTED_TPU:
        assert accel == EXPECTED_TPU[path.name]
    generation = accel.split("-")[0]
    assert node_type["node_config"]["runtimeVersion"] == RUNTIME_VERSIONS[generation]

    # Static slice: the group never scales, and nothing else can be launched.
    assert node_type["min_workers"] == node_type["max_workers"] == 1
    assert config["max_workers"] == 1
    head = config["available_node_types"][config["head_node_type"]]
    assert head["min_workers"] == head["max_workers"] == 0

    # Resources are applied per HOST (RAY_OVERRIDE_RESOURCES on each host's `ray start`).
    chips_per_host = ray_tpu.get_num_tpu_visible_chips_per_host(accel)
    hosts = ray_tpu.get_total_chips_from_accelerator_type(accel) // chips_per_host
    assert hosts >= 2, f"{accel} is a single-host slice, not a pod slice"
    resources = node_type["resources"]
    assert resources["TPU"] == chips_per_host
    assert resources[f"TPU-{accel}-head"] == 1
    assert resources[HOST_RESOURCE] == 1

    # What each host's raylet actually gets after Ray's TPU command runner rewrites the env.
    per_host = []
    for worker_id in range(hosts):
        env = gcp.tpu_runner._maybe_remove_head_resource(
            {ray_constants.RESOURCES_ENVIRONMENT_VARIABLE: resources}, worker_id, accel
        )
        per_host.append(env[ray_constants.RESOURCES_ENVIRONMENT_VARIABLE])
    assert all(r["TPU"] == chips_per_host and r[HOST_RESOURCE] == 1 for r in per_host)
    assert [f"TPU-{accel}-head" in r for r in per_host] == [True] + [False] * (hosts - 1)
    # One HostWorker per host: a STRICT_SPREAD group of `hosts` bundles {TPU, hicache_host} fits
    # exactly, and a second group cannot squeeze in.
    assert sum(r[HOST_RESOURCE] for r in per_host) == hosts


@pytest.mark.parametrize("path", _gcp_configs(), ids=_ids(_gcp_configs()))
def test_every_node_can_write_gcs(path, gcp):
    config = _ray_up_offline(_load(path), gcp)
    for name, node_type in config["available_node_types"].items():
        accounts = node_type["node_config"].get("serviceAccounts", [])
        scopes = {s for account in accounts for s in account.get("scopes", [])}
        assert scopes & GCS_SCOPES, f"{name}: no GCS read/write scope in {scopes}"


@pytest.mark.parametrize("path", _gcp_configs(), ids=_ids(_gcp_configs()))
def test_token_auth_on_for_every_ray_start(path, gcp):
    config = _ray_up_offline(_load(path), gcp)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts, f"{key}: no `ray start`"
        for cmd in starts:
            assert re.search(r"export RAY_AUTH_MODE=token\b.*ray start", cmd, re.S), cmd
    mounts = config["file_mounts"]
    assert mounts.get(TOKEN_FILE) == TOKEN_FILE, "the token file must be shipped to every node"


@pytest.mark.parametrize("path", _gcp_configs(), ids=_ids(_gcp_configs()))
def test_memlock_unlimited_for_ray_processes(path, gcp):
    config = _ray_up_offline(_load(path), gcp)
    docker_opts = " ".join(
        str(o) for k in ("run_options", "worker_run_options") for o in config["docker"].get(k, [])
    )
    if re.search(r"--ulimit[ =]memlock=-1", docker_opts):
        return
    for cmd in _start_commands(config):
        if "ray start" not in cmd:
            continue
        # The limit must be raised in the shell that execs `ray start` (hard limit first).
        before = cmd.split("ray start")[0]
        assert re.search(r"prlimit --pid \$BASHPID --memlock=unlimited:unlimited", before), cmd
        assert "ulimit -l unlimited" in before, cmd
    assert "memlock unlimited" in json.dumps(config["initialization_commands"])


@pytest.mark.parametrize("path", _gcp_configs(), ids=_ids(_gcp_configs()))
def test_setup_installs_hicache_tpu_and_matching_ray(path, gcp):
    config = _ray_up_offline(_load(path), gcp)
    _, node_type = _tpu_node_type(config, gcp)
    # After merge_setup_commands: global setup + worker setup, unless the node type overrides.
    tpu_setup = node_type.get("worker_setup_commands", config["worker_setup_commands"])
    assert any(re.search(r"pip install .*hicache\[tpu\]", c) for c in tpu_setup), tpu_setup
    head_setup = config["head_setup_commands"]
    assert any(re.search(r"pip install .*hicache", c) for c in head_setup), head_setup
    assert any("google-api-python-client" in c for c in head_setup), "autoscaler on head needs it"
    # The cluster runs the Ray this client runs (job submission and the autoscaler need that).
    pins = set(re.findall(r"ray\[default\]==([\w.]+)", json.dumps(config["setup_commands"])))
    assert pins == {ray.__version__}


@pytest.mark.parametrize("path", _gcp_configs(), ids=_ids(_gcp_configs()))
def test_file_mount_sources_exist(path, gcp):
    config = _ray_up_offline(_load(path), gcp)
    for remote, local in config["file_mounts"].items():
        if local == TOKEN_FILE:
            continue  # created by `ray get-auth-token --generate` on the user's machine
        # Local paths are relative to where `ray up` runs: the repo root.
        assert (REPO / local).exists(), f"{remote}: {local} is not in the repo"


def test_tpu_configs_differ_only_in_slice_and_zone():
    """The three TPU files are one template; drift in anything but the slice is a bug."""

    def shared(config: dict) -> dict:
        varying = ("cluster_name", "provider", "available_node_types")
        return {k: v for k, v in config.items() if k not in varying}

    configs = [_load(CONFIGS / name) for name in EXPECTED_TPU]
    assert all(shared(c) == shared(configs[0]) for c in configs)
    heads = [c["available_node_types"][c["head_node_type"]] for c in configs]
    assert all(h == heads[0] for h in heads)


# ---------------------------------------------------------------- local fake multi-node config


@pytest.fixture(scope="module")
def local_config() -> dict:
    return _load(CONFIGS / LOCAL)


def test_local_config_passes_ray_validation(local_config):
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_TYPE
    from ray.autoscaler._private.providers import _NODE_PROVIDERS

    # The monitor (`ray start --autoscaling-config`) validates the file as read, no defaults merged.
    autoscaler_util.validate_config(copy.deepcopy(local_config))
    assert local_config["provider"]["type"] == "fake_multinode"
    assert local_config["head_node_type"] == FAKE_HEAD_NODE_TYPE
    provider_cls = _NODE_PROVIDERS["fake_multinode"](local_config["provider"])
    assert provider_cls.bootstrap_config(copy.deepcopy(local_config)) == local_config
    host, port = local_config["provider"]["gcs_address"].rsplit(":", 1)
    assert host == "127.0.0.1" and port.isdigit()


def test_local_config_mirrors_the_tpu_layout(local_config):
    node_types = local_config["available_node_types"]
    head = node_types[local_config["head_node_type"]]
    workers = [nt for name, nt in node_types.items() if name != local_config["head_node_type"]]
    assert len(workers) == 1
    (hosts,) = workers
    assert hosts["min_workers"] == hosts["max_workers"] == 2 == local_config["max_workers"]
    assert hosts["resources"][HOST_RESOURCE] == 1
    assert head["resources"][HEAD_RESOURCE] == 1 and HOST_RESOURCE not in head["resources"]


def test_local_autoscaler_launches_exactly_two_hosts(local_config, monkeypatch):
    """Ray's scheduler, on the fake provider, launches the static 2-host group (no process starts)."""
    from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
    from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
    from ray.autoscaler._private.resource_demand_scheduler import ResourceDemandScheduler

    monkeypatch.setenv("RAY_FAKE_CLUSTER", "1")
    config = copy.deepcopy(local_config)
    autoscaler_util.fill_node_type_min_max_workers(config)
    provider = FakeMultiNodeProvider(config["provider"], config["cluster_name"])
    scheduler = ResourceDemandScheduler(
        provider,
        config["available_node_types"],
        config["max_workers"],
        config["head_node_type"],
        config["upscaling_speed"],
    )
    nodes = provider.non_terminated_nodes({})
    head_ip = provider.internal_ip(nodes[0])
    head_resources = config["available_node_types"][config["head_node_type"]]["resources"]

    def plan(demands):
        return scheduler.get_nodes_to_launch(
            nodes=nodes,
            launching_nodes={},
            resource_demands=demands,
            unused_resources_by_ip={head_ip: dict(head_resources)},
            pending_placement_groups=[],
            max_resources_by_ip={head_ip: dict(head_resources)},
            ensure_min_cluster_size=[],
            node_availability_summary=NodeAvailabilitySummary(node_availabilities={}),
        )

    to_launch, infeasible = plan([])
    assert to_launch == {"hicache.host": 2} and infeasible == []
    # Three per-host workers cannot fit on a 2-host group: the third is reported, not launched.
    to_launch, infeasible = plan([{HOST_RESOURCE: 1}] * 3)
    assert to_launch == {"hicache.host": 2}
    assert infeasible == [{HOST_RESOURCE: 1}]


# ---------------------------------------------------------------- runtime_env files


@pytest.mark.parametrize("path", _runtime_envs(), ids=_ids(_runtime_envs()))
def test_runtime_env_is_valid_and_names_repo_paths(path, monkeypatch, tmp_path):
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.runtime_env import RuntimeEnv

    monkeypatch.chdir(REPO)  # `ray job submit` runs from the repo root; local paths resolve there
    env = parse_runtime_env_args(runtime_env=str(path))  # exactly `ray job submit --runtime-env`
    RuntimeEnv(**env)  # Ray's field validation (types, known plugins); nothing is installed
    assert all(isinstance(v, str) for v in env.get("env_vars", {}).values())
    assert env.get("env_vars", {}).get("RAY_AUTH_MODE", "token") != "disabled"

    local_paths = []
    if "working_dir" in env:
        local_paths.append(env["working_dir"])
    local_paths += [m for m in env.get("py_modules", []) if "://" not in m]
    local_paths += [
        p for p in (env.get("pip") or []) if isinstance(p, str) and p.startswith((".", "/"))
    ]
    for rel in local_paths:
        assert not Path(rel).is_absolute(), f"{rel}: paths are relative to the repo root"
        assert (REPO / rel).exists(), f"{rel} does not exist in the repo"

    if "working_dir" in env:
        work = REPO / env["working_dir"]
        assert work.is_dir()
        # What JobSubmissionClient.submit_job does next, with the upload recorded, not sent.
        uploads = []
        packaged = upload_working_dir_if_needed(
            dict(env),
            include_gitignore=True,
            upload_fn=lambda d, excludes, is_file=False: uploads.append((d, excludes)),
        )
        assert [d for d, _ in uploads] == [env["working_dir"]]
        assert packaged["working_dir"].startswith("gcs://_ray_pkg_")
        # The package Ray builds from it: benchmarks/ as a folder of that name (entrypoints import
        # `benchmarks.X`), nothing else; a hicache/ folder would shadow the installed package (whose
        # subpackages live in other top-level folders).
        from ray._private.runtime_env.packaging import create_package

        from hicache.cli import BENCH_EXCLUDES

        assert env["excludes"] == list(BENCH_EXCLUDES), "hicache bench ships what `ray job submit` does"
        zip_path = tmp_path / "pkg.zip"
        create_package(str(work), zip_path, include_gitignore=True, excludes=uploads[0][1])
        names = zipfile.ZipFile(zip_path).namelist()
        assert "benchmarks/multiturn.py" in names and "benchmarks/workload.py" in names
        assert all(n.startswith("benchmarks/") for n in names), sorted(names)[:20]
        assert not any("__pycache__" in n or n.endswith(".json") for n in names)


@pytest.mark.parametrize("path", sorted((CONFIGS / "replicas").glob("*.yaml")), ids=lambda p: p.name)
def test_replica_file_l3_sections_parse(path):
    """Each replica file's ``l3`` section (if any) is a valid start storage for its model."""
    from hicache.replica_file import load_replica_file

    raw = yaml.safe_load(path.read_text())
    if raw.get("l3") is None:
        pytest.skip("no l3 section")
    params = load_replica_file(path).storage
    assert params.url == raw["l3"]["url"]
    assert params.fingerprint.model_id == raw["l3"]["model_id"]


def test_loading_replica_files_touches_no_cluster():
    """Parsing is pure: a TPU replica file describes its slice (one bundle per host) and reserves it only when
    the head creates the placement group, so loading one neither starts nor joins a Ray cluster."""
    code = (
        "import glob, ray\n"
        "from hicache.replica_file import load_replica_file\n"
        "for p in sorted(glob.glob('ray_configs/replicas/*.yaml')):\n"
        "    w = load_replica_file(p).workers\n"
        "    print(p, w.num_hosts, w.placement.bundles[0], w.placement.tpu_slice is not None)\n"
        "print('ray initialized:', ray.is_initialized())\n"
    )
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "ray initialized: False"
    v6e = next(line for line in lines if "v6e-16" in line)
    assert v6e.endswith("4 {'TPU': 4, 'hicache_host': 1} True")  # 16 chips, 4 per host, slice still to reserve


@pytest.mark.parametrize("path", sorted((CONFIGS / "replicas").glob("*.yaml")), ids=lambda p: p.name)
def test_replica_files_coordinate_jax_on_host0_not_loopback(path):
    """Every replica file, TPU or fake CPU hosts, leaves the jax.distributed coordinator to host 0's own
    node address (a fixed 127.0.0.1 makes hosts 1..H dial themselves on a real slice)."""
    from hicache.replica_file import load_replica_file

    assert load_replica_file(path).workers.coordinator_host is None


def test_replica_file_call_timeout_and_bad_coordinator_hosts(tmp_path):
    from hicache.cluster.ray_workers import WorkerGroupOptions
    from hicache.replica_file import replica_config
    from hicache.workers import KVCacheSpec

    raw = {"replica": "r", "page_size": 4, "l1_pages": 8, "model": {"num_layers": 1, "num_kv_heads": 2, "head_dim": 4},
           "workers": {"platform": "cpu", "num_hosts": 2, "call_timeout_s": 7}}
    assert replica_config(raw).workers.call_timeout_s == 7.0
    with pytest.raises(ValueError, match="call_timeout_s"):
        replica_config({**raw, "workers": {**raw["workers"], "call_timeout_s": 0}})
    spec = KVCacheSpec(1, 2, 4, 4, "float32")
    for bad in ("", 127):
        with pytest.raises(ValueError, match="coordinator_host"):
            WorkerGroupOptions.fake_cpu_hosts(spec, 2, coordinator_host=bad)


def test_replica_file_preemption_section(tmp_path):
    """``preemption:`` names where the head watches for a notice (ReplicaConfig.preemption); a bad
    section is one ValueError naming the key or the value."""
    from hicache.cluster.drain import NoticeSourceKind
    from hicache.replica_file import replica_config

    raw = {"replica": "r", "page_size": 4, "l1_pages": 8}
    assert replica_config(raw).preemption is None
    p = replica_config({**raw, "preemption": {"kind": "file", "location": str(tmp_path / "notice"),
                                              "deadline_s": 20, "poll_s": 0.5}}).preemption
    assert (p.kind, p.location, p.deadline_s, p.poll_s) == (NoticeSourceKind.FILE, str(tmp_path / "notice"), 20.0, 0.5)
    assert replica_config({**raw, "preemption": {}}).preemption.kind is NoticeSourceKind.GCE
    for bad, match in (({"kind": "sms"}, "unknown notice source 'sms'"), ({"kind": "file"}, "needs its path"),
                       ({"when": 3}, r"preemption: unknown key\(s\) \['when'\]"), ({"poll_s": 0}, "poll_s"),
                       ("gce", "preemption must be a mapping")):
        with pytest.raises(ValueError, match=match):
            replica_config({**raw, "preemption": bad})


def test_replica_file_l3_previous_fingerprints(tmp_path):
    """``l3.previous_fingerprints: [{model_id, dtype?}]``: the model's earlier fingerprints (same KV shape) that
    explain a miss as fingerprint_differs; a bad entry is a ValueError naming it."""
    from hicache.replica_file import replica_config
    from hicache.storage import ModelFingerprint

    raw = {"replica": "r", "page_size": 4, "l1_pages": 8, "l2_slots": 16, "workers": {"platform": "cpu", "num_hosts": 1},
           "model": {"num_layers": 2, "num_kv_heads": 4, "head_dim": 4, "dtype": "bfloat16"},
           "l3": {"url": "memory://kv", "model_id": "m-v2",
                  "previous_fingerprints": [{"model_id": "m-v1"}, {"model_id": "m-v2", "dtype": "float32"}]}}
    st = replica_config(raw).storage
    assert st.fingerprint == ModelFingerprint("m-v2", "bfloat16", 4, 2, 4, 4)
    assert st.previous_fingerprints == (ModelFingerprint("m-v1", "bfloat16", 4, 2, 4, 4),
                                        ModelFingerprint("m-v2", "float32", 4, 2, 4, 4))
    for bad, match in (([{"dtype": "float32"}], r"previous_fingerprints\[0\]"), (["m-v1"], "model_id"),
                       ([{"model_id": "m-v1", "shape": 1}], "shape"), ([{"model_id": "m-v2"}], "itself")):
        with pytest.raises(ValueError, match=match):
            replica_config({**raw, "l3": {**raw["l3"], "previous_fingerprints": bad}})
