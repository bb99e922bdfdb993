"""Lowering: aten graph -> `EpilogueSpec` (plain data). No CUDA in here.

`HELD_BACK_OPS` are the ops whose Inductor decompositions are held back so the
matcher sees them whole; whatever is not fused is decomposed afterwards.
"""

import torch

from .matcher import Chain, Refusal, linear_form, match_graph
from .spec import Anchor, EpilogueSpec, Step
from .vocabulary import VOCABULARY, run_reference

aten = torch.ops.aten

HELD_BACK_OPS = (
    aten.addmm,
    aten.native_group_norm,
    aten.native_layer_norm,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten.gelu,
    aten.silu,
    aten.leaky_relu,
    aten.logsumexp,
    aten.mish,
    aten.hardswish,
    aten.hardsigmoid,
    aten.hardtanh,
    aten.clamp,
    aten.elu,
    aten.celu,
    aten.softplus,
    aten._softmax,
    aten._log_softmax,
    aten.amax,
    aten.amin,
)

__all__ = [
    "Anchor",
    "Chain",
    "EpilogueSpec",
    "HELD_BACK_OPS",
    "Refusal",
    "Step",
    "VOCABULARY",
    "linear_form",
    "match_graph",
    "run_reference",
]
