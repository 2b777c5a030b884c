"""Where an L3 hit of a hybrid tree may end (``storage_components.servable_end``): at the last page end where
every component's objects before it are stored (Mamba: the state at that end; SWA: the window's pages),
never past what the Full pages reached, never below the prefetch minimum."""

from __future__ import annotations

import pytest

from hicache.cluster.storage_components import servable_end

T, F = True, False


@pytest.mark.parametrize("flags, pages, found, least, want", [
    ({"mamba": [F, T, F, T, F]}, {"mamba": 1}, 5, 1, 4),  # the last state before the Full pages' end
    ({"mamba": [F, T, F, T, F]}, {"mamba": 1}, 3, 1, 2),  # cut by the Full pages (or the cost model)
    ({"mamba": [F, T, F, F, F]}, {"mamba": 1}, 5, 3, 0),  # the only state ends below the minimum: a miss
    ({"mamba": [F, F, F]}, {"mamba": 1}, 3, 1, 0),  # no state at all: a miss, never a hit without one
    ({"swa": [F, T, T, T, F]}, {"swa": 3}, 5, 1, 4),  # the window's three pages before the end
    ({"swa": [F, F, T, T, T]}, {"swa": 3}, 5, 1, 5),
    ({"swa": [T, T, F, T, T]}, {"swa": 3}, 5, 1, 2),  # a hole in the window: back to where it is whole
    ({"swa": [T, F, F]}, {"swa": 3}, 3, 1, 1),  # a window reaching before the fetch: the tree's own pages
    ({"swa": [T, T, T, T], "mamba": [F, F, T, F]}, {"swa": 2, "mamba": 1}, 4, 1, 3),  # every pool at once
    ({"swa": [T, F, T, T], "mamba": [F, F, T, F]}, {"swa": 2, "mamba": 1}, 4, 1, 0),
])
def test_servable_end(flags, pages, found, least, want):
    assert servable_end(flags, pages, found, least) == want
