"""The epilogue vocabulary: every step the project can fuse, with its plain-torch reference.

One entry per step name. The matcher (`lowering/matcher.py`) turns aten nodes into
these names; `cuda_templates/snippets.py` holds the device code for the same names
(a test keeps the two tables in step). The references define what a fused op must
compute, and are what the op runs on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .spec import CHANNEL, FULL, ONE, SCALAR, SELF, Step


@dataclass(frozen=True)
class StepKind:
    """One vocabulary entry.

    Attributes:
        name: the step name used in specs, kernels and `FUSEDEPI_DISABLE`.
        reference: computes the step in plain torch:
            (x, step, params) -> x, where params are the op's tensors after the
            anchor operands. Steps with extra outputs return (x, [extra, ...]).
    """

    name: str
    reference: Callable


def _param(params, index):
    return None if index < 0 else params[index]


def _operand(x, step: Step, params):
    if step.operand == SCALAR:
        return step.consts[0]
    if step.operand == SELF:
        return x
    t = params[step.inputs[0]]
    if step.operand == FULL:
        # The chain may have passed through views (3-D linear); the fused op
        # works on the 2-D anchor output, so residuals are read flat.
        return t.reshape(x.shape)
    if step.operand == CHANNEL:
        # Per-channel operands broadcast on the channel axis (dim 1), whatever their
        # own shape ([C], [C, 1, 1], ...): a folded conv bias is [C].
        return t.reshape([1, -1] + [1] * (x.dim() - 2))
    assert step.operand == ONE
    return t


def _binary(fn):
    def ref(x, step, params):
        other = _operand(x, step, params)
        return fn(other, x) if step.reverse else fn(x, other)

    return ref


def _batchnorm_train(x, step, params):
    w, b, rm, rv = (_param(params, i) for i in step.inputs)
    momentum, eps = step.consts
    new_rm, new_rv = rm.clone(), rv.clone()
    out = F.batch_norm(x, new_rm, new_rv, w, b, training=True, momentum=momentum, eps=eps)
    return out, [new_rm, new_rv]


VOCABULARY: dict[str, StepKind] = {
    kind.name: kind
    for kind in [
        StepKind("relu", lambda x, s, p: torch.relu(x)),
        StepKind("gelu", lambda x, s, p: F.gelu(x)),
        StepKind("gelu_tanh", lambda x, s, p: F.gelu(x, approximate="tanh")),
        StepKind("leaky_relu", lambda x, s, p: F.leaky_relu(x, s.consts[0])),
        StepKind("silu", lambda x, s, p: F.silu(x)),
        StepKind("sigmoid", lambda x, s, p: torch.sigmoid(x)),
        StepKind("tanh", lambda x, s, p: torch.tanh(x)),
        StepKind("add", _binary(torch.add)),
        StepKind("sub", _binary(torch.sub)),
        StepKind("mul", _binary(torch.mul)),
        StepKind("div", _binary(torch.div)),
        StepKind(
            "groupnorm",
            lambda x, s, p: F.group_norm(
                x, s.groups, _param(p, s.inputs[0]), _param(p, s.inputs[1]), s.consts[0]
            ),
        ),
        StepKind(
            "layernorm",
            lambda x, s, p: F.layer_norm(
                x, (x.shape[-1],), _param(p, s.inputs[0]), _param(p, s.inputs[1]), s.consts[0]
            ),
        ),
        StepKind(
            "batchnorm_eval",
            lambda x, s, p: F.batch_norm(
                x,
                _param(p, s.inputs[2]),
                _param(p, s.inputs[3]),
                _param(p, s.inputs[0]),
                _param(p, s.inputs[1]),
                training=False,
                eps=s.consts[0],
            ),
        ),
        StepKind("batchnorm_train", _batchnorm_train),
        StepKind("logsumexp", lambda x, s, p: torch.logsumexp(x, dim=1, keepdim=s.keepdim)),
    ]
}


def run_reference(x: torch.Tensor, steps, params) -> list[torch.Tensor]:
    """Applies `steps` to the anchor output `x` in plain torch.

    Returns:
        [out, *extra_outputs] (extra outputs: BatchNorm's new running stats).
    """
    extras: list[torch.Tensor] = []
    for step in steps:
        result = VOCABULARY[step.name].reference(x, step, params)
        if isinstance(result, tuple):
            x, more = result
            extras.extend(more)
        else:
            x = result
    return [x] + extras
