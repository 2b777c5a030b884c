"""L1 (device) allocation and eviction: pages for requests, victims leaf-first in policy order.

``alloc`` evicts when the free list is short; ``evict`` frees a token amount on demand and drives the
extra components' own eviction. Victims with an L2 copy stay as host-only nodes (merged with a host-only
child in Full-only trees: ``HostMerge``); the others leave the tree. A HiCache controller sees each batch
of victims first (``before_device_evict``: write_back backs them up there). Runs on the head.
"""

from __future__ import annotations

import numpy as np

from hicache.cluster.tree.allocator import CacheCapacityError, PageIds, PageOwner, as_page_array
from hicache.cluster.tree.host_merge import HostMerge
from hicache.cluster.tree.params import EvictResult


class DeviceEviction(HostMerge):
    """L1 allocation and eviction of ``RadixTree``; see the module docstring."""

    def evict(self, num_tokens: int = 0, **component_amounts: int) -> EvictResult:
        """Frees at least ``num_tokens`` L1 tokens if possible, leaf-first in policy order.

        Victims with an L2 copy stay in the tree as host-only nodes; others are removed. With a
        ``before_device_evict`` hook (write_back), each batch of victims is offered to it first.
        ``component_amounts`` drive the extra components' own eviction by their ``evict_param``
        (``swa_num_tokens=...``: SWA tombstones, ``mamba_num=...``: Mamba states).
        """
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if component_amounts:
            params = {c.evict_param: c for c in self.extra_components if c.evict_param}
            for name, amount in component_amounts.items():
                if name not in params:
                    raise ValueError(f"unknown eviction amount {name!r}; this tree takes {sorted(params)}")
                if not isinstance(amount, (int, np.integer)) or isinstance(amount, bool) or amount < 0:
                    raise ValueError(f"{name} must be an int >= 0, got {amount!r}")
        freed = self._evict_full(num_tokens) if num_tokens else 0
        if not component_amounts:
            return EvictResult(freed)
        done = {name: params[name].evict_component(int(amount)) for name, amount in component_amounts.items()}
        return EvictResult(freed, done)

    def _evict_full(self, num_tokens: int) -> int:
        """Evicts L1 victims in batches; each batch's pages go back to the allocator in ONE release."""
        freed = 0
        hooks = self.hooks
        full = self.full
        queue = full.queue
        listener = self.listener
        merge = not self.extra_components  # host-only chains merge in Full-only trees
        while freed < num_tokens:
            batch, batch_tokens = [], 0
            while freed + batch_tokens < num_tokens:
                node = queue.pop()
                if node is None:
                    break
                batch.append(node)
                batch_tokens += node.num_tokens
            if not batch:
                break
            if self.before_device_evict is not None:
                self.before_device_evict(batch)
            dropped = []  # the victims' page arrays, deepest-popped first at release
            for node in batch:
                if node.parent is None or node.device_pages is None or node.lock_ref:
                    continue  # changed while the hook ran (it may process transfer acks)
                dropped.append(node.device_pages)  # unlocked: its tokens were evictable
                node.device_pages = None
                freed += node.num_tokens
                full.evictable_tokens -= node.num_tokens
                for on_device_drop in hooks.on_device_drop:
                    on_device_drop(node)
                if listener is not None:
                    listener.on_removed(node, "device")
                parent = node.parent
                if node.host_slots is not None:  # demoted: host-only now
                    if merge and len(node.children) == 1:
                        self._merge_host_only(node)
                elif not node.children or not self.storage_only.keep(node):
                    self._remove_leaf(node)  # (a node kept for its storage-only children stays)
                if parent.parent is not None:
                    full.maybe_push(parent)
                    for after_device_evict in hooks.after_device_evict:
                        freed += after_device_evict(parent)
            if dropped:
                # Victims in reverse pop order: the free stack ends up as with one release per victim.
                dropped.reverse()
                full.allocator.release(dropped[0] if len(dropped) == 1 else np.concatenate(dropped))
        self._evicted_tokens += freed
        if queue.needs_compact(len(self._nodes)):  # (no node generator per eviction)
            queue.rebuild(self.iter_nodes())
        return freed

    def alloc(self, num_tokens: int) -> np.ndarray:
        """L1 pages for ``num_tokens`` tokens (rounded up to pages), evicting unlocked leaves if needed."""
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        need = -(-int(num_tokens) // self.page_size)
        alloc = self.full.allocator
        if need > alloc.num_free and alloc.bounded:
            self.make_room(need, num_tokens)
        return alloc.alloc(need)

    def make_room(self, num_pages: int, num_tokens: int) -> None:
        """Evicts L1 victims until ``num_pages`` pages are free (``alloc`` of ``num_tokens`` tokens; a load-back
        allocates its chain's pages after it). CacheCapacityError, evicting nothing, when free plus evictable
        pages cannot cover them; also (after evicting) when evictable tokens were locked behind children."""
        alloc = self.full.allocator
        short = num_pages - alloc.num_free
        if short <= 0 or not alloc.bounded:
            return
        ps = self.page_size
        if short * ps > self.full.evictable_tokens:
            raise CacheCapacityError(
                f"alloc({num_tokens}) needs {num_pages} pages: {alloc.num_free} free and "
                f"{self.full.evictable_tokens // ps} evictable"
            )
        self._evict_full(short * ps)
        if alloc.num_free < num_pages:  # evictable tokens were locked behind children; report honestly
            raise CacheCapacityError(f"alloc({num_tokens}) needs {num_pages} pages, only {alloc.num_free} free")

    def free(self, pages: PageIds) -> None:
        """Returns request-held pages to the free list (never pages the tree owns)."""
        self.full.allocator.free(as_page_array(pages), PageOwner.REQUEST)
