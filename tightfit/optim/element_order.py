"""The order in which a param's elements are laid out in its pages.

Pages hold flat element ranges, so every param needs one fixed order of its elements, decided
when its pages are laid out and kept for as long as the pages live:

* a contiguous real param: its elements as ``p.view(-1)`` gives them (the common case, and
  the fast path everywhere);
* a complex param: as real pairs (``torch.view_as_real``), torch's own rule for Adam: the
  update of a complex param equals the update of its real view, element by element;
* a dense, non-overlapping but non-contiguous param (``channels_last`` weights, a transposed
  matrix): its *storage* order, so its pages still map onto its memory one to one and the
  kernel updates the param in place;
* anything else (a strided slice with gaps): row-major order, and each step updates a
  contiguous staging copy that is then written back into the param (:meth:`ElementOrder.view`
  returns ``None`` for such a param).

Grads and state-dict tensors, whatever their own strides, are read in the same order
(:meth:`ElementOrder.flat`), and state tensors handed out are shaped like the param again
(:meth:`ElementOrder.shaped`, a view of the flat memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tightfit.optim.dtensor import local_tensor


@dataclass(frozen=True)
class ElementOrder:
    """How one param's elements are ordered in its pages.

    Attributes:
        perm: the dims of the (real) param from outermost to innermost in memory, or
            ``None`` for row-major order (``view(-1)``).
        complex: the param is complex; its pages hold real pairs.
    """

    perm: tuple[int, ...] | None = None
    complex: bool = False

    @property
    def plain(self) -> bool:
        """Row-major and real: ``view(-1)`` / ``reshape(-1)`` give the page order."""
        return self.perm is None and not self.complex

    def _real(self, t: torch.Tensor) -> torch.Tensor:
        t = local_tensor(t)
        return torch.view_as_real(t) if self.complex and t.is_complex() else t

    def ordered(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (shaped like the param) with its dims permuted into page order."""
        r = self._real(t)
        return r if self.perm is None else r.permute(self.perm)

    def view(self, p: torch.Tensor) -> torch.Tensor | None:
        """The param's elements in page order as one flat view of its memory (the kernel
        updates it in place), or ``None`` when its memory is not in that order (then the
        update goes through a staging copy)."""
        o = self.ordered(p)
        return o.view(-1) if o.is_contiguous() else None

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """The elements of ``t`` (a grad or a state value shaped like the param) in page
        order, flat: a view when its memory is in that order, else a copy."""
        return self.ordered(t).reshape(-1)

    def shaped(self, flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """``flat`` (page order) as a tensor shaped like ``p``'s local tensor, complex when
        ``p`` is: a view of ``flat`` with ``p``'s strides where ``p`` is stored in page
        order."""
        lp = local_tensor(p)
        shape = list(lp.shape) + ([2] if self.complex else [])
        if self.perm is None:
            out = flat.view(shape)
        else:
            out = flat.view([shape[d] for d in self.perm]).permute(_inverse(self.perm))
        return torch.view_as_complex(out) if self.complex else out


PLAIN = ElementOrder()


def order_of(p: torch.Tensor) -> ElementOrder:
    """The element order pages use for ``p`` (see the module docstring)."""
    lp = local_tensor(p)
    is_complex = lp.is_complex()
    r = torch.view_as_real(lp) if is_complex else lp
    if r.is_contiguous():
        return ElementOrder(None, is_complex)
    # memory order: dims by decreasing stride (size-1 dims anywhere; ties keep dim order)
    perm = tuple(sorted(range(r.dim()), key=lambda d: (-r.stride(d), d)))
    if r.permute(perm).is_contiguous():
        return ElementOrder(perm, is_complex)
    return ElementOrder(None, is_complex)  # overlapping or with gaps: staged, row-major


def real_numel(p: torch.Tensor) -> int:
    """Elements of ``p``'s local tensor as its pages count them (2 per complex value)."""
    lp = local_tensor(p)
    return lp.numel() * (2 if lp.is_complex() else 1)


def _inverse(perm: tuple[int, ...]) -> list[int]:
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return inv
