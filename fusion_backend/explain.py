"""`explain(model, *inputs)`: which chains were fused, which were refused and why."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import collect_reports, fusedepi
from .rewrite import Record


@dataclass
class ExplainReport:
    """The fusion decisions of one compile.

    Attributes:
        fused: records of fused chains (fusion name, kernel, nodes covered).
        refused: records of candidate chains left to Inductor, with the reason.
        note: why there is nothing to report, where there is nothing.
    """

    fused: list
    refused: list
    note: str = ""

    def __str__(self) -> str:
        from tabulate import tabulate

        if self.note:
            return self.note

        fused = tabulate(
            [(r.anchor, r.fusion, r.kernel, " ".join(r.nodes), r.stop, r.measured) for r in self.fused],
            headers=["anchor", "fusion", "kernel", "nodes", "chain ends because", "measured"],
        )
        refused = tabulate(
            [(r.anchor, " ".join(r.nodes), r.reason) for r in self.refused],
            headers=["anchor", "nodes", "why not fused"],
        )
        parts = [f"fused chains: {len(self.fused)}" + (f"\n{fused}" if self.fused else "")]
        parts.append(f"refused candidates: {len(self.refused)}" + (f"\n{refused}" if self.refused else ""))
        if not self.fused:
            parts.append("no chain fused: Inductor compiled the model as it would without fusedepi")
        return "\n\n".join(parts)


def explain(model: torch.nn.Module, *example_inputs, verbose: bool = True) -> ExplainReport:
    """Compiles `model` with fusedepi, runs it once on `example_inputs`, and reports.

    The model's buffers (BatchNorm running statistics) are restored afterwards, so
    explaining does not count as a training step. Dynamo's caches are reset before
    and after, so the report reflects a fresh compile.

    Args:
        model: the module to explain.
        *example_inputs: inputs for one forward call.
        verbose: also print the report as tables.

    Returns:
        The report; `str(report)` is the printed table.
    """
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    reports: list = []
    torch._dynamo.reset()
    try:
        with collect_reports(reports):
            torch.compile(model, backend=fusedepi)(*example_inputs)
    finally:
        torch._dynamo.reset()
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    records: list[Record] = [r for report in reports for r in report.records]
    result = ExplainReport(
        fused=[r for r in records if r.status == "fused"],
        refused=[r for r in records if r.status == "refused"],
    )
    if not records:
        from .config import load_config

        result.note = ("FUSEDEPI_DISABLE=all: every graph went to Inductor unfused" if load_config().disable_all
                       else "no candidate chain: no graph holds a matmul (linear, addmm, mm, matmul, bmm) or a "
                            "convolution that fusedepi starts a chain at")
    if verbose:
        print(result)
    return result
