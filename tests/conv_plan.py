"""conv_sm90's constants for a whole test or fuzzer run, so that a switch still off
(`cuda_templates.conv_sm90.WINDOW_BOX`, `PAD_PIXELS`, ...) is checked on a GPU before it
is switched on: FUSEDEPI_TEST_CONV_PLAN="NAME=VALUE ..." (kernel_variants' `--plan`
items, space-separated) sets them in each pytest process (conftest.py) and in each of the
fuzzer's workers (fuzzer._setup_worker). The backend itself never reads it."""

from __future__ import annotations

import os

ENV = "FUSEDEPI_TEST_CONV_PLAN"


def apply_from_env(set_constant=setattr) -> dict:
    """Sets conv_sm90's constants named in FUSEDEPI_TEST_CONV_PLAN (through
    `set_constant(module, name, value)`); returns them ({} where it is unset).

    Raises:
        ValueError: an item that is not NAME=VALUE of a conv_sm90 constant and a literal.
    """
    from benchmarks.kernel_variants import parse_plan, set_plan

    plan = parse_plan(os.environ.get(ENV, "").split())
    set_plan(plan, set_constant)
    return plan
