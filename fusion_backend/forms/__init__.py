"""The table of forms: the other ways a chain's library anchor can run, each taken where
it is measured faster at the graph's shapes on the GPU at hand.

A form changes HOW the anchor runs, never WHAT the chain computes: the spec records it
(`Anchor.pad`, `Anchor.channels_last`, an `mm` whose bias is the first step), so the
renderer, the launchers and `explain` read the decision instead of re-deriving it.

| form | applies to | the other form |
|---|---|---|
| `gemm_bias` | float32 `addmm` of a Linear, matmul precision "highest" | `mm`, the bias added in the epilogue |
| `gemm_padding` | 16-bit `addmm`/`mm` whose K or N is not a multiple of 8 | the GEMM on zero-padded operands |
| `library_conv` | a conv the direct conv would compute (stride 1, few input channels) | the library conv and the epilogue kernel |
| `conv_layout` | a 2-D/3-D library conv with a channels-last epilogue mapping | cuDNN on channels-last operands |
| `in_kernel_conv` | a 2-D or 3-D conv (groups 1, strides up to 8) with a pointwise chain or a norm over whole channels, on sm_90 | the conv computed in the chain's kernel |
| `conv_recompute` | an in-kernel conv with a norm whose statistics its tiles take | the conv run twice: moments, then the normed chain; its value never written |
| `gemm_consumers` | a 16-bit in-kernel GEMM whose CTAs have tiles for the spare warps | the chain in the consumer warps |

Each row's setting (`Config`, one environment variable each; `conv_recompute`'s "off"
unless set) is "auto" (time both
forms of the library call side by side, `timings.compare_ms`, and take the other where it is at least
1 / MIN_GAIN times faster; on CUDA only), "on" (always) or "off" (never). Times live in
the one cache (`timings.CACHE_FILE`), keyed by the form's name and what the call's
speed depends on. The measured choice (`choice.decide`) then times the chain in the
forms taken against Inductor; where a form's library call alone does not show what the
form costs the rest of the chain (`Form.chain_decides`: the conv layout, whose epilogue
kernel and input copies differ), the chain is timed without that form too, and the
faster of the two is the one compared with Inductor (`FormChoice.alternative`). A
row with no library call of its own (`Form.timed_as_chain`: the library conv in place of
the direct conv, the in-kernel conv, its norm recomputed, the in-kernel GEMM's consumer
warps) is decided by
the chain's timing alone: taken wherever
the measured choice times the chain, which times it both ways; the graph's form
elsewhere. Where several rows take their forms for one chain (a conv: the library conv
instead of the direct conv, channels-last, the in-kernel conv, then its norm recomputed), the chain is timed
in each form and the fastest kept (`rewrite._without_forms`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from lowering.spec import EpilogueSpec

from .. import choice, timings
from ..config import Config
from .base import Form
from .conv_implicit import ConvImplicit
from .conv_layout import ConvLayout
from .conv_library import ConvLibrary
from .conv_recompute import ConvRecompute
from .gemm_bias import GemmBias
from .gemm_consumers import GemmConsumers
from .gemm_padding import GemmPadding

log = logging.getLogger("fusedepi")

# In the order they are tried: at most one applies to a chain (float32 Linear, 16-bit
# Linear on the library path, 16-bit in-kernel GEMM) but for a conv's four, and a later
# one sees the spec an earlier one made (`conv_layout` may take the library conv that
# `library_conv` took in place of the direct conv; the in-kernel conv's alternative is
# the library conv in the layout `conv_layout` chose; `conv_recompute` recomputes the
# in-kernel conv's norm).
FORMS: tuple[Form, ...] = (GemmBias(), GemmPadding(), ConvLibrary(), ConvLayout(), ConvImplicit(), ConvRecompute(),
                           GemmConsumers())
BY_NAME = {form.name: form for form in FORMS}

# The other form must be at least this much faster than the graph's: it costs a little
# that a timing of the library call alone does not see (a padding copy's launches, a
# bias the epilogue loads, the staged epilogue of a channels-last conv).
MIN_GAIN = 0.9


@dataclass(frozen=True)
class FormChoice:
    """What one row of the table found for a chain: the library call's milliseconds as
    the graph has it and in the row's form (0 where not timed), and whether the form
    was taken."""

    form: str
    what: str  # the other form, in words
    graph_ms: float
    form_ms: float
    taken: bool
    note: str = ""  # why it was not timed
    # Where the library call alone took the form and does not show the rest of the
    # chain's cost in it (`Form.chain_decides`): the spec without the form, which the
    # measured choice times the whole chain in too (`rewrite`), and what that found.
    alternative: EpilogueSpec | None = None
    chains: str = ""
    by_chain: bool = False  # the row's form has no library call to time (`Form.timed_as_chain`)

    def describe(self) -> str:
        verdict = "taken" if self.taken else "not taken"
        if self.note:
            return f"{self.form}: {verdict} ({self.note})"
        if self.by_chain:
            return f"{self.form}: {verdict} ({self.chains or 'the chain not timed'})"
        chains = f"; {self.chains}" if self.chains else ""
        return f"{self.form}: {verdict} ({self.form_ms:.4g} ms against {self.graph_ms:.4g} ms{chains})"


def choose(chain, cfg: Config) -> tuple[FormChoice, ...]:
    """Runs the table on `chain`: each row that applies is decided by its setting and,
    under "auto", by a timing; a form taken updates `chain.spec` (and, for the bias,
    moves the bias node from `chain.operands` to `chain.params`). Returns the rows that
    applied. A timing that fails keeps the graph's form with a warning (raises under
    strict mode)."""
    rows = []
    for form in FORMS:
        setting = getattr(cfg, form.setting)
        if setting == "off":
            continue
        found = form.candidate(chain)
        if found is None:
            continue
        what = form.describe(found)
        if setting == "on":
            chain.spec = form.apply(chain, found)
            rows.append(FormChoice(form.name, what, 0.0, 0.0, True, f"{form.env}=1"))
            continue
        device = chain.anchor.meta["val"].device
        if device.type != "cuda":
            continue
        if form.timed_as_chain:
            if not choice.timed_on(device, cfg):
                continue  # nothing times the chain: the graph's form
            rows.append(FormChoice(form.name, what, 0.0, 0.0, True, alternative=chain.spec, by_chain=True))
            chain.spec = form.apply(chain, found)
            continue
        key = "|".join(str(part) for part in (form.name, torch.cuda.get_device_name(device), torch.__version__,
                                              *form.key(found)))
        try:
            graph_ms, form_ms = timings.cached(Path(cfg.cache_dir) / timings.CACHE_FILE, key,
                                               lambda: form.measure(found, device))
        except Exception as err:  # noqa: BLE001 - the chain runs as the graph has it
            if cfg.strict:
                raise
            log.warning("fusedepi: timing %s failed (%s: %s); it runs as the graph has it", what,
                        type(err).__name__, err)
            rows.append(FormChoice(form.name, what, 0.0, 0.0, False, f"timing failed: {type(err).__name__}"))
            continue
        taken = form_ms < MIN_GAIN * graph_ms
        row = FormChoice(form.name, what, graph_ms, form_ms, taken,
                         alternative=chain.spec if taken and form.chain_decides else None)
        if row.taken:
            log.info("fusedepi: %s: %.4f ms against %.4f ms", what, form_ms, graph_ms)
            chain.spec = form.apply(chain, found)
        rows.append(row)
    return tuple(rows)


__all__ = ["BY_NAME", "FORMS", "MIN_GAIN", "Form", "FormChoice", "choose"]
