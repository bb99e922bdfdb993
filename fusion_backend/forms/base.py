"""One row of the table of forms (`forms.FORMS`)."""

from __future__ import annotations

from typing import Callable

import torch

from lowering.spec import EpilogueSpec

from .. import timings
from ..ops import arch_of, conv_allows_tf32


def conv_op_shapes(chain) -> tuple[tuple, tuple] | None:
    """A conv chain's x and weight shapes as its fused op takes them (`Anchor.op_shapes`;
    a dynamic size at its hint), or None where one has no hint: what the conv rows'
    timings depend on."""
    x_shape, w_shape = (timings.example_shape(n.meta["val"]) for n in chain.operands[:2])
    if x_shape is None or w_shape is None:
        return None
    return chain.spec.anchor.op_shapes(x_shape, w_shape)


def conv_found(chain, planned: Callable[[str, bool], bool]) -> tuple | None:
    """A conv row's `candidate`: (dtype, x's shape, the weight's shape, TF32) where x is
    on a GPU and `planned(arch, tf32)` (whether the row's kernel covers the chain in its
    form there, TF32 as cuDNN's setting allows) holds, else None."""
    xv = chain.operands[0].meta["val"]
    if xv.device.type != "cuda":
        return None
    tf32 = chain.spec.dtype == "float32" and conv_allows_tf32()
    if not planned(arch_of(xv.device), tf32):
        return None
    shapes = conv_op_shapes(chain)
    return None if shapes is None else (chain.spec.dtype, *shapes, tf32)


def conv_in_words(found: tuple) -> str:
    """A conv row's `found` (dtype, x's shape, the weight's shape, TF32) in words."""
    dtype, x_shape, w_shape, tf32 = found
    return f"{dtype}{' in TF32' if tf32 else ''}, input {list(x_shape)}, weight {list(w_shape)}"


class Form:
    """Another way to run a chain's library anchor. A subclass names its row and says
    where it applies, what decides its speed, how to time it and what it makes of the
    spec; `forms.choose` does the rest."""

    name = ""  # the row's name: in explain, the log and the cache key
    setting = ""  # the Config field that switches it: "auto", "on" or "off"
    env = ""  # that field's environment variable
    # Whether the library call's timing leaves out a cost of the form to the rest of the
    # chain, so that a form it takes is checked by timing the whole chain both ways.
    chain_decides = False
    # Whether the form has no library call of its own to time (it changes the fused
    # kernel): under "auto" it is taken wherever the measured choice will time the chain,
    # which then times the chain without it too and keeps the faster; elsewhere the
    # graph's form stays.
    timed_as_chain = False

    def candidate(self, chain) -> tuple | None:
        """What the timing depends on (shapes, mostly) where the form applies to
        `chain` as it stands, else None."""
        raise NotImplementedError

    def describe(self, found: tuple) -> str:
        """The other form at `found`, in words."""
        raise NotImplementedError

    def key(self, found: tuple) -> tuple:
        """What the library call's speed depends on besides the GPU and torch's version:
        the cache key's parts."""
        raise NotImplementedError

    def measure(self, found: tuple, device: torch.device) -> tuple[float, float]:
        """(ms as the graph has it, ms in this form) of one library call at `found`, on
        real tensors of fresh values, side by side (`timings.compare_ms`)."""
        raise NotImplementedError

    def apply(self, chain, found: tuple) -> EpilogueSpec:
        """`chain.spec` in this form at `found` (`candidate`'s), `chain`'s operand lists
        updated where it moves one."""
        raise NotImplementedError

    def applied(self, spec: EpilogueSpec) -> bool:
        """Whether `spec` runs in this form (what `apply` made of it). Needed by the rows
        the measured choice decides (`chain_decides`, `timed_as_chain`): the rewrite
        times the chain in each form a row took and without it, and reads back from the
        fastest spec which rows it keeps."""
        raise NotImplementedError
