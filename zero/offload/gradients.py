"""Stage 3's gradient shards in the offload store (zero/offload/shards.py's streamed step reads them): each bucket's
gradient of the window, its norm taken when complete, and the clipping's factors kept beside it until the step
multiplies them in ([Note: only the storage moves])."""
from __future__ import annotations

import torch

from zero.offload.store import Store


class Gradients:
    """Stage 3's gradient shards in the store: each bucket's accumulated gradient of the window under ("grads", b),
    its norm when complete, the clipping scales not yet multiplied into it, and which optimizers let go of it."""

    def __init__(self, store: Store):
        self.store = store
        self.norms: dict[int, torch.Tensor] = {}  # bucket -> its gradient's 2-norm, taken when complete
        self.scales: dict[int, list[torch.Tensor]] = {}  # bucket -> clip_grad_norm_'s factors not yet applied
        self.zeroed: set[int] = set()  # buckets zero_grad(set_to_none=False) left as zeros

    def add(self, b: int, chunk: torch.Tensor, first: bool, final: bool, master: torch.dtype) -> None:
        """This micro-batch's reduced chunk into bucket ``b``'s gradient shard: copied in (the window's first, as
        ``chunk.to(master, copy=True)``), or added to it (zeros included: 0 + g, as the in-memory shard); its norm
        taken once the window's last micro-batch is in (``final``)."""
        name = ("grads", b)
        if name not in self.store:
            self.store.create(name, chunk.numel(), master)
        if first:
            grad = self.store.fresh(name)
            grad.copy_(chunk)
        else:
            grad = self.take(b)
            grad.add_(chunk)
        self.zeroed.discard(b)
        self.scales.pop(b, None)
        if final:
            self.norms[b] = torch.linalg.vector_norm(grad, 2.0)
        self.store.put(name, grad)

    def take(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s gradient shard with the clipping scales applied (the store keeps the unscaled values and
        the scales until the shard is written again)."""
        if b in self.zeroed:
            return self.store.fresh(("grads", b)).zero_()
        grad = self.store.take(("grads", b))
        for scale in self.scales.get(b, []):
            grad.mul_(scale)
        return grad

    def norms_of(self, buckets: list[int], norm_type: float) -> list[torch.Tensor]:
        """Each bucket's gradient's ``norm_type``-norm: the ones taken when complete, or read again."""
        if norm_type == 2.0 and all(b in self.norms for b in buckets):
            return [self.norms[b] for b in buckets]
        norms = []
        for b in buckets:
            grad = self.take(b)
            norms.append(torch.linalg.vector_norm(grad, norm_type))
            self.store.discard(grad)
        return norms

    def scale(self, buckets: list[int], factor: torch.Tensor) -> None:
        for b in buckets:
            self.scales.setdefault(b, []).append(factor)
            self.norms.pop(b, None)

    def drop(self, b: int, zeros: bool) -> None:
        """Bucket ``b``'s gradient let go of (or left as zeros: set_to_none=False)."""
        self.store.forget(("grads", b))
        self.norms.pop(b, None)
        self.scales.pop(b, None)
        (self.zeroed.add if zeros else self.zeroed.discard)(b)
