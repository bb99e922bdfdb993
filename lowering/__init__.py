"""Lowering: aten graph -> `EpilogueSpec` (plain data). No CUDA in here.

`HELD_BACK_OPS` are the ops whose Inductor decompositions are held back so the
matcher sees them whole (derived from the vocabulary's rows); whatever is not fused is
decomposed afterwards.
"""

from .matcher import MATRIX_OPS, Chain, Refusal, linear_form, match_graph
from .spec import Anchor, EpilogueSpec, Step
from .vocabulary import VOCABULARY, held_back_ops, run_reference

HELD_BACK_OPS = held_back_ops()

__all__ = [
    "Anchor",
    "Chain",
    "EpilogueSpec",
    "HELD_BACK_OPS",
    "MATRIX_OPS",
    "Refusal",
    "Step",
    "VOCABULARY",
    "linear_form",
    "match_graph",
    "run_reference",
]
