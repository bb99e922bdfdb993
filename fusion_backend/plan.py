"""The execution plan of a chain: HOW its spec runs on this device at the graph's shapes.

Plain data, decided once while compiling and read afterwards: the spec in the forms
taken (what the renderer and the launchers read: `Anchor.pad`, `Anchor.channels_last`,
`Anchor.gemm`), the kernel built for it, what each row of the table of forms found
(`forms.choose`) and what the measured choice found against Inductor (`choice.decide`).
`explain` prints it; nothing re-derives it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .choice import Choice
from .forms import FormChoice


@dataclass(frozen=True)
class ExecutionPlan:
    spec: str  # the spec's JSON, in the forms taken: the fused op's argument
    kernel: str  # the kernel's readable name, with how its anchor runs
    forms: tuple[FormChoice, ...]  # the rows of the table of forms that applied
    choice: Choice  # fused or Inductor

    @property
    def fused(self) -> bool:
        return self.choice.fuse

    def describe(self) -> str:
        """The measurements behind the plan, for `explain`: each form's row, then the
        choice against Inductor; empty where nothing was decided."""
        parts = [row.describe() for row in self.forms]
        choice = self.choice.describe()
        if choice:
            parts.append(choice)
        return "; ".join(parts)
