"""Where an L3 hit of a hybrid tree may end (``storage_components.servable_end``): at the last page end where
every component's object of that end is stored (Mamba: the state at that end; SWA: the window's pages before it,
one object named by the end's last page),
never past what the Full pages reached, never below the prefetch minimum."""

from __future__ import annotations

import pytest

from hicache.cluster.storage_components import servable_end

T, F = True, False


@pytest.mark.parametrize("flags, found, least, want", [
    ({"mamba": [F, T, F, T, F]}, 5, 1, 4),  # the last state before the Full pages' end
    ({"mamba": [F, T, F, T, F]}, 3, 1, 2),  # cut by the Full pages (or the cost model)
    ({"mamba": [F, T, F, F, F]}, 5, 3, 0),  # the only state ends below the minimum: a miss
    ({"mamba": [F, F, F]}, 3, 1, 0),  # no state at all: a miss, never a hit without one
    ({"swa": [F, F, F, T, F]}, 5, 1, 4),  # the object of the window before the end 4 (its last page's key)
    ({"swa": [F, F, T, F, T]}, 5, 1, 5),
    ({"swa": [T, T, T, F, F]}, 5, 1, 3),  # no object at the ends 4, 5: back to the last end that has one
    ({"swa": [T, T, T, T], "mamba": [F, F, T, F]}, 4, 1, 3),  # every pool at once
    ({"swa": [T, F, F, T], "mamba": [F, F, T, F]}, 4, 1, 0),
])
def test_servable_end(flags, found, least, want):
    assert servable_end(flags, found, least) == want


def test_fetched_swa_window_is_split_over_the_nodes_it_ends_in():
    """A fetch over storage-only entries may end in a node shorter than the window: each node of the fetch
    gets the part of the window's pages within its own pages (the last node its last ones)."""
    import numpy as np

    from hicache.cluster.component_host import ComponentHostPool
    from hicache.cluster.storage_components import ComponentObjects, FetchParts
    from hicache.cluster.tree import RadixTree, SWAComponent, TreeConfig

    tree = RadixTree(TreeConfig(page_size=8), [SWAComponent(24)])  # a window of 3 pages
    tree.storage_only.cap_tokens = 1 << 10
    tokens = np.arange(96, dtype=np.int32)
    root = tree.default_root
    assert tree.storage_only.add_path(root, tokens[:80]) == 80
    assert tree.storage_only.add_path(root, tokens) == 16  # a 2-page child below the 10-page entry
    (a,) = root.children.values()
    (b,) = a.children.values()
    nodes = tree.storage_only.adopt(root, tokens)
    assert nodes == [a, b]
    pool = ComponentHostPool(tree, tree.component("swa"), 8)
    values = ComponentObjects({"swa": pool}, 8)
    fetched = values.reserve(12, 0, [f"{i:064x}" for i in range(12)])
    assert isinstance(fetched, FetchParts) and fetched.parts[0].first_page == 9 and fetched.parts[0].key == f"{11:064x}"
    ids = fetched.reserved[0][1].copy()
    values.adopt(nodes, fetched)
    swa = tree.component("swa")
    np.testing.assert_array_equal(swa.host_copy(b), ids[1:])
    np.testing.assert_array_equal(swa.host_copy(a), ids[:1])
    assert pool.stats()["host_tokens"] == 24 and values.counters.values_fetched == 3
