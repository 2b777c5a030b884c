"""ray_configs/rehearsal.yaml, the ``ray up`` file of the rehearsal cluster (``hicache.testing.ray_up``):
it resolves the way ``ray up`` resolves it (Ray's ``prepare_config`` -> local provider -> ``validate_config``),
its addresses are the ones the rehearsal networks give their head and TPU hosts, and its start commands keep
the rules the harness depends on. No namespace, no SSH, no Ray process: the slow
``tests/rehearsal/test_ray_up.py`` brings the file up for real."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from ray.autoscaler._private import util as autoscaler_util
from ray.autoscaler._private.local.config import LOCAL_CLUSTER_NODE_TYPE

from hicache.testing.netns import NamespaceNetwork
from hicache.testing.ray_up import (
    CLIENT,
    HEAD,
    REHEARSAL_CONFIG,
    RayUpCluster,
    RayUpLauncher,
    check_addresses,
    load_config,
    subnet,
    tpu_hosts,
)
from hicache.testing.rehearsal import RehearsalCluster, RehearsalOptions


@pytest.fixture(scope="module")
def config() -> dict:
    return load_config(REHEARSAL_CONFIG)


def test_resolves_like_ray_up_with_a_static_group_of_two_tpu_hosts(config):
    resolved = autoscaler_util.prepare_config(copy.deepcopy(config))
    autoscaler_util.validate_config(resolved)
    hosts = resolved["available_node_types"][LOCAL_CLUSTER_NODE_TYPE]
    assert hosts["min_workers"] == hosts["max_workers"] == 2 == len(config["provider"]["worker_ips"])
    assert tpu_hosts(config) == ["tpu0", "tpu1"]


def test_addresses_are_the_rehearsal_networks(config):
    """Both harnesses build networks (constructors only: nothing is created) whose head and TPU hosts have
    exactly the file's addresses; another subnet is refused."""
    up = RayUpCluster()
    assert up.net.address(HEAD) == config["provider"]["head_ip"]
    assert [up.net.address(t) for t in up.tpus] == config["provider"]["worker_ips"]
    assert up.launcher.cluster_config()["cluster_name"] == up.cluster_name == f"hc-{up.net.owner}"
    rehearsal = RehearsalCluster(RehearsalOptions(subnet=subnet(config)))
    check_addresses(config, rehearsal.net)
    elsewhere = NamespaceNetwork([HEAD, *tpu_hosts(config), CLIENT], "10.213.9.0/24")
    with pytest.raises(ValueError, match="addresses"):
        check_addresses(config, elsewhere)
    with pytest.raises(ValueError, match="client"):
        RayUpLauncher(NamespaceNetwork([HEAD, *tpu_hosts(config)], subnet(config)), config)


def test_start_commands_keep_the_harness_rules(config):
    head, worker = " ".join(config["head_start_ray_commands"]), " ".join(config["worker_start_ray_commands"])
    for cmd in (head, worker):
        assert "ray stop" not in cmd  # it would stop every Ray process on the machine
        assert "RAY_AUTH_MODE=token" in cmd and "--node-ip-address=$(hostname -I" in cmd
        assert "--temp-dir=$RAY_TMPDIR/ray" in cmd  # each host's own folder (its login environment)
    assert "RAY_enable_autoscaler_v2=0" in head and "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    assert re.search(r"--resources='\{\"hicache_head\": 1\}'", head)
    assert re.search(r"--resources='\{\"hicache_host\": 1\}'", worker) and "--address=$RAY_HEAD_IP:6379" in worker
    assert config["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}


def test_a_file_that_is_not_a_local_provider_file_is_refused(tmp_path, config):
    bad = copy.deepcopy(config)
    bad["provider"] = {"type": "gcp", "region": "us-central2"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="local provider"):
        load_config(path)
    bad = copy.deepcopy(config)
    bad["auth"]["ssh_private_key"] = "/root/.ssh/id_ed25519"  # this machine's key, not the client host's
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="ssh_private_key"):
        load_config(path)


def test_the_rehearsal_starts_through_ray_up_only_with_the_files_hosts():
    """``Launcher.RAY_UP`` (constructor only): the file's TPU hosts and addresses, nothing else."""
    from hicache.testing.rehearsal import Launcher

    rc = RehearsalCluster(RehearsalOptions(launcher="ray_up"))
    assert rc.options.launcher is Launcher.RAY_UP and rc.tpu_hosts == ["tpu0", "tpu1"]
    with pytest.raises(ValueError, match="TPU hosts"):
        RehearsalCluster(RehearsalOptions(tpu_hosts=3, launcher=Launcher.RAY_UP))
    with pytest.raises(ValueError, match="addresses"):
        RehearsalCluster(RehearsalOptions(subnet="10.213.9.0/24", launcher=Launcher.RAY_UP))
    with pytest.raises(ValueError, match="launcher"):
        RehearsalOptions(launcher="ssh")
