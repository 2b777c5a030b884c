"""The head builds its tree from ``HeadConfig.components`` (SWA, Mamba) and replica files name them; bad
component configs are a ValueError naming the value, before anything is built."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.cluster import CacheHead, HeadConfig, embedded
from hicache.cluster.begin import BeginParams
from hicache.cluster.builder import ComponentKind, MambaConfig, SWAConfig
from hicache.cluster.policy import HiCacheConfig
from hicache.cluster.tree import CacheCapacityError, MambaMatch, RadixKey, RequestState, TreeConfig
from hicache.replica_file import load_replica_file, replica_config

PS = 4


def test_head_builds_the_components_it_names():
    config = HeadConfig(tree=TreeConfig(PS, 64), components=[MambaConfig(8), SWAConfig(8, 64)])
    assert config.components == (SWAConfig(8, 64), MambaConfig(8))  # a tuple, in ComponentKind order
    assert config.component_kinds == (ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA)
    head = CacheHead(config)
    assert head.tree.component_names == ("full", "swa", "mamba")
    stats = head.cache_stats()
    assert stats["swa"]["capacity_pages"] == 16 and stats["mamba"]["capacity_slots"] == 8
    assert CacheHead(HeadConfig()).tree.component_names == ("full",)
    assert "swa" not in CacheHead(HeadConfig()).cache_stats()


def test_a_mamba_head_begins_a_request_and_caches_its_state():
    client = embedded(HeadConfig(tree=TreeConfig(PS, 32), components=(MambaConfig(2),)))
    key = RadixKey(np.arange(12, dtype=np.int32))
    begun = client.begin_request(BeginParams(key, 13))
    assert begun.match.components["mamba"] == MambaMatch(-1, 0)
    (mamba,) = begun.components.values()
    assert mamba.copies == ()  # nothing cached: the request starts from the zero state
    client.cache_finished_req(RequestState(key, begun.pages, 0, begun.match.last_device_node, 0, begun.components))
    again = client.begin_request(BeginParams(key, 13))
    assert again.match.device_hit_len == 12 and again.match.components["mamba"].state_slot == mamba.slot
    assert again.components["mamba"].copies == ((mamba.slot, again.components["mamba"].slot),)
    # both slots in use (one cached, one working): a third request cannot start; nothing leaks
    before = client.cache_stats()
    with pytest.raises(CacheCapacityError, match="Mamba pool"):
        client.begin_request(BeginParams(RadixKey(np.arange(100, 108, dtype=np.int32)), 9))
    assert client.cache_stats() == before


def test_a_mamba_head_gives_a_track_slot_only_to_a_decode_that_crosses_a_page_end():
    client = embedded(HeadConfig(tree=TreeConfig(PS, 64), components=(MambaConfig(8),)))
    key = RadixKey(np.arange(9, dtype=np.int32))
    # the decode computes [9, total - 1); at 13 the finished key ends at 12, page-aligned: the working slot serves
    for total, track in ((11, False), (13, False), (14, True), (20, True)):
        begun = client.begin_request(BeginParams(key, total))
        assert (begun.components["mamba"].track >= 0) is track, total
        state = RequestState(key, begun.pages, 0, begun.match.last_device_node, 0, begun.components)
        client.abandon_request(state)
    assert client.cache_stats()["mamba"]["request_slots"] == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(components=[SWAConfig(8), SWAConfig(4)]), "'swa' configured twice"),
        (dict(components=["swa"]), "got 'swa'"),
        (dict(components=SWAConfig(8)), "sequence of SWAConfig"),
        (dict(components=[SWAConfig(8, 4)]), "num_tokens=4 is smaller than one request's window"),
        (dict(components=[MambaConfig(1)]), "num_slots=1"),
        (dict(components=[SWAConfig(8, host_tokens=4)], hicache=HiCacheConfig(16)),
         r"swa host_tokens=4 cannot hold one window \(window=8\)"),
    ],
)
def test_bad_component_configs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HeadConfig(**kwargs)


@pytest.mark.parametrize("host_slots", [0, -1, True, 2.0])
def test_a_mamba_l2_of_no_state_is_refused(host_slots):
    with pytest.raises(ValueError, match=f"mamba host_slots must be a positive int or None, got {host_slots!r}"):
        MambaConfig(4, host_slots=host_slots)


def test_a_mamba_l2_defaults_to_the_full_l2s_pages():
    cfg = HeadConfig(components=(MambaConfig(4),), hicache=HiCacheConfig(16))
    assert cfg.component_host_slots() == {"mamba": 16}
    cfg = HeadConfig(components=(MambaConfig(4, host_slots=3),), hicache=HiCacheConfig(16))
    assert cfg.component_host_slots() == {"mamba": 3}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MambaConfig(4, ((0,),)), r"got \(0,\)"),
        (lambda: MambaConfig(4, ()), "non-empty tuple"),
        (lambda: MambaConfig(0), "num_slots must be a positive int or None, got 0"),
        (lambda: MambaConfig(4, dtype="nope"), "unknown state dtype 'nope'"),
        (lambda: SWAConfig(0), "got 0"),
    ],
)
def test_component_configs_check_their_fields(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_replica_file_names_components(tmp_path):
    path = tmp_path / "hybrid.yaml"
    path.write_text(
        "replica: hy\npage_size: 4\nl1_pages: 64\ncomponents:\n"
        "  swa: {window: 16, num_tokens: 128}\n"
        "  mamba: {num_slots: 8, state_shapes: [[4, 8], [2]], dtype: float32}\n"
    )
    head = load_replica_file(path).head
    assert head.components == (SWAConfig(16, 128), MambaConfig(8, ((4, 8), (2,)), "float32"))
    assert CacheHead(head).tree.component_names == ("full", "swa", "mamba")
    assert replica_config({"components": {"swa": None}} | {"components": {"swa": {"window": 8}}}).head.components == (
        SWAConfig(8),)


def test_replica_file_swa_host_tier_needs_the_swa_layers_of_the_workers():
    raw = {"page_size": 4, "l1_pages": 64, "l2_slots": 64, "workers": {"platform": "cpu", "num_hosts": 1},
           "components": {"swa": {"window": 16, "num_tokens": 128, "host_tokens": 96}},
           "model": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}}
    with pytest.raises(ValueError, match=r"config: the swa component has a host tier.*component_specs\['swa'\]"):
        replica_config(raw)
    cfg = replica_config(raw | {"model": raw["model"] | {"swa_layers": 2}})
    (pool,) = cfg.head.component_pools(cfg.workers.component_specs)
    assert (pool.name, pool.spec.num_layers, pool.num_device_pages, pool.host_slots) == ("swa", 2, 32, 24)


@pytest.mark.parametrize(
    "components, match",
    [
        ({"lstm": {}}, r"unknown key\(s\) \['lstm'\]"),
        ({"swa": {"window": -1}}, "got -1"),
        ({"swa": {"window": 8, "foo": 1}}, r"components.swa: unknown key\(s\) \['foo'\]"),
        ({"mamba": {"state_shapes": [[0]]}}, r"got \(0,\)"),
        ({"mamba": {"state_shapes": 3}}, "state_shapes must be a list of shapes, got 3"),
        ({"swa": [8]}, r"components.swa must be a mapping of fields, got \[8\]"),
        (["swa"], r"components must be a mapping .* got \['swa'\]"),
    ],
)
def test_replica_file_bad_components(components, match):
    with pytest.raises(ValueError, match=match):
        replica_config({"components": components})


def test_swa_head_translates_trims_and_abandons():
    head = CacheHead(HeadConfig(tree=TreeConfig(PS, 16), components=(SWAConfig(8, 64),)))
    key = RadixKey(np.arange(24, dtype=np.int32))
    begun = head.begin_request(BeginParams(key, 25))
    swa = head.swa_pages(begun.pages)
    assert swa.dtype == np.int32 and swa.shape == begun.pages.shape and (swa >= 0).all()  # every page maps one
    assert len(set(swa.tolist())) == swa.size
    state = RequestState(key, begun.pages, 0, begun.match.last_device_node)
    assert head.trim_request(state) == 4  # pages [0, (24 - 8) / 4): out of the window
    before = head.cache_stats()["swa"]
    assert head.abandon_request(state) == 7 and head.tree.stats().request_pages == 0
    assert head.cache_stats()["swa"]["free_pages"] > before["free_pages"]
    head.tree.check_invariants()
    with pytest.raises(ValueError, match=r"outside L1 \[0, 16\)"):
        head.swa_pages(np.array([16]))
    with pytest.raises(ValueError, match="1-D int array"):
        head.swa_pages(np.array([[1]]))
    with pytest.raises(ValueError, match=r"no component 'swa' in this tree \(components: full\)"):
        CacheHead(HeadConfig(tree=TreeConfig(PS, 16))).swa_pages(np.array([0]))


def test_abandon_request_checks_the_request_and_changes_nothing_on_bad_input():
    head = CacheHead(HeadConfig(tree=TreeConfig(PS, 16), components=(MambaConfig(4),)))
    key = RadixKey(np.arange(8, dtype=np.int32))
    begun = head.begin_request(BeginParams(key, 9))
    before = head.cache_stats()
    with pytest.raises(ValueError, match="lacks 'mamba'"):
        head.abandon_request(RequestState(key, begun.pages, 0, begun.match.last_device_node))
    assert head.cache_stats() == before
    head.abandon_request(RequestState(key, begun.pages, 0, begun.match.last_device_node, 0, begun.components))
    assert head.cache_stats()["mamba"]["request_slots"] == 0 and head.tree.stats().request_pages == 0
