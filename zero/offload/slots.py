"""A checkpoint's window on the offload store (zero.checkpoint's save and load of an offloaded stage): the boxes DCP
writes and reads are ranges of the store's slots ([Note: stored pieces] in zero/pieces.py), brought in whole slot by
whole slot, a few at a time, so a checkpoint of a state larger than the memory streams through it.

[Note: a save's boxes] DCP's writer asks for one box at a time (its serial loader: zero.checkpoint's Writer turns off
the loader that copies ahead), serializes it, and keeps a reference to the last box of every name until the rank's
file is closed. So each box is copied out of its slot into one scratch buffer and handed over on a storage of
exactly its bytes (zero/pieces.py's exact_storage): every reference DCP keeps is to that same buffer, never to the
slots, which go back to the store as others come in. A slot is read whole, so its CRC32C is checked before any of it
is written into a checkpoint: a state flipped on the disk stops the save in one line instead of being saved.

[Note: a load's boxes] DCP's reader copies each read item into the view ``resolve_tensor`` gives, one at a time.
Here that view is into the slot's buffer, zeros at its first touch (a load writes every element the run needs; what
it does not write is no run's state, or the padding), read back from the store where the cache had to let it go
before DCP was done with it; a slot is written once, when it leaves the cache or at the end.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import torch

from zero.offload.store import Store
from zero.pieces import StoredBox, exact_storage


class SlotCache:
    """Whole slots of ``store``, kept while their boxes are read (a save) or written (a load), least recently used
    out first past ``budget_bytes``."""

    def __init__(self, store: Store, budget_bytes: int = 256 * 2**20):
        self.store, self.budget_bytes = store, budget_bytes
        self.held: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.dirty: set[Hashable] = set()
        self.touched: set[Hashable] = set()  # slots a load has written to (a second touch reads them back)
        self.scratch = torch.empty(0, dtype=torch.uint8)

    def read_box(self, box: StoredBox) -> torch.Tensor:
        """A save's box: its values copied into the scratch buffer, on a storage of exactly their bytes ([Note: a
        save's boxes])."""
        slot = self._slot(box.source, loading=False)
        nbytes = box.count * box.dtype.itemsize
        if self.scratch.numel() < nbytes:
            self.scratch = torch.empty(max(nbytes, 2 * self.scratch.numel()), dtype=torch.uint8)
        run = exact_storage(self.scratch[:nbytes].view(box.dtype))
        run.copy_(slot[box.first:box.first + box.count])
        return box.view(run)

    def write_box(self, box: StoredBox) -> torch.Tensor:
        """A load's box: a view of its slot for DCP to copy into ([Note: a load's boxes])."""
        slot = self._slot(box.source, loading=True)
        self.dirty.add(box.source)
        return box.view(slot[box.first:box.first + box.count])

    def _slot(self, name: Hashable, loading: bool) -> torch.Tensor:
        slot = self.held.get(name)
        if slot is not None:
            self.held.move_to_end(name)
            return slot
        if loading and name not in self.touched:
            slot = self.store.fresh(name).zero_()
            self.touched.add(name)
        else:
            slot = self.store.take(name)
        self.held[name] = slot
        while len(self.held) > 1 and sum(t.numel() * t.element_size() for t in self.held.values()) > self.budget_bytes:
            self._let_go(next(iter(self.held)))
        return slot

    def _let_go(self, name: Hashable) -> None:
        slot = self.held.pop(name)
        if name in self.dirty:
            self.dirty.discard(name)
            self.store.put(name, slot)
        else:
            self.store.discard(slot)

    def close(self) -> None:
        """Every slot let go of, the written ones written back."""
        while self.held:
            self._let_go(next(iter(self.held)))
        self.scratch = torch.empty(0, dtype=torch.uint8)
