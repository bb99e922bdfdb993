"""A kernel header's variants timed on one device: the GPU time of fusedepi's kernels on
zoo models or workloads, each variant a copy of `cuda_templates/include/` with one header
edited (text replaced), one process a variant (the kernel libraries a process loads are
keyed by kernel name, so two variants of one kernel never share a process).

    FUSEDEPI_IN_KERNEL_CONV=1 python -m benchmarks.kernel_variants \\
        --header conv_sm90.cuh --models conv2d_wide_relu_bias --dtypes bfloat16 \\
        --variant tree \\
        --variant no_bulk 'hop::bulk_store(a.out + lo' 'if (lo < 0) hop::bulk_store(a.out + lo'

A variant is a name and then pairs OLD NEW: each OLD must occur in the header exactly
once and is replaced by NEW; a name alone is the tree's headers. Variants that cut work
out of a kernel give wrong results and times only (the error column says so).
`FUSEDEPI_AUTOTUNE=off` in each run: the form the matcher and the settings pick is built,
not the measured choice's (set `FUSEDEPI_IN_KERNEL_CONV=1` and the like for the form to
look at). Per model, dtype and variant it prints the GPU time a call of the kernels whose
names match `--kernels` (fusedepi's own by default), of all kernels, and the error
against float64; `--json` writes the rows.

`--preset NAME` runs a named set of variants of one header (PRESETS: the
decompositions whose figures benchmarks/NOTES.md quotes), before any `--variant`:

    FUSEDEPI_IN_KERNEL_CONV=1 python -m benchmarks.kernel_variants --preset conv-parts \
        --models conv2d_bn_relu conv2d_relu_bias --dtypes bfloat16 --kernels '_conv<'

`--plan NAME=VALUE` (repeatable) sets one of the in-kernel conv's plan constants
(`cuda_templates.conv_sm90`'s upper-case names: SHARED_ROWS, SHARED_ROWS_PATCH_W,
MAX_PATCH_W, ...; VALUE a Python literal) in every variant's process, so that a tiling
rule is timed against the tree's as a header edit is:

    FUSEDEPI_IN_KERNEL_CONV=1 python -m benchmarks.kernel_variants --variant tree \
        --plan 'SHARED_ROWS_PATCH_W=128' --models conv2d_bn_relu --dtypes bfloat16 --kernels '_conv<'
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FUSED_KERNELS = r"_sm[0-9]+a?_"  # fusedepi's kernels: the arch, then a role

# The in-kernel conv's parts (conv_sm90.cuh), each cut out of the kernel (wrong results,
# times only): x's patch copied for a tile's first k-step only; the tile's moments; its
# bulk copies; its chain and staging; the consumers' wait for the previous k-step's wgmma.
_CONV_A_ONCE = [
    ("hop::mbar_expect_tx(&full[s], (kWindow ? chunks * kWinBoxBytes : kNchwRegs ? kNchwBoxBytes : kStageA) +\n"
     "                                            (kResidentW ? 0 : kStageB));",
     "hop::mbar_expect_tx(&full[s], (i == 0 ? kStageA : 0) + (kResidentW ? 0 : kStageB));"),
    ("          } else {\n            hop::tma_load_4d(tiles_a + s * kStageA, &map_x, &full[s], c0, w0 * kSW",
     "          } else if (i == 0) {\n            hop::tma_load_4d(tiles_a + s * kStageA, &map_x, &full[s], c0, w0 * kSW"),
]
_CONV_MOMENTS = [("      if constexpr (kMoments) {  // the tile's moments, on the finishers' barrier",
                  "      if constexpr (false) {")]
_CONV_STORE = [("      } else if constexpr (kStores) {\n        store_runs(",
                "      } else if constexpr (false) {\n        store_runs(")]
_CONV_STAGE = [("        stage_chain<kPass>(d[b], chans, staging, kPingPong ? b : half, tid, img, h0, w0, n0, a);", "")]
_CONV_WAIT = [("hop::wgmma_wait<1>();  // the previous k-step's wgmma is done: free its stage", "// no wait")]
# Named sets of variants: name -> (header, {variant: its (old, new) pairs}). Each edit
# must still apply once to the header as it stands (tests/test_kernel_variants.py).
PRESETS = {
    # Where a 2-D channels-last conv's kernel time goes: the finish's parts, then the
    # mainloop with one copy of x's patch a tile.
    "conv-parts": ("conv_sm90.cuh", {
        "tree": [],
        "no_moments": _CONV_MOMENTS,
        "no_store": _CONV_STORE,
        "no_stage": _CONV_STAGE,
        "no_finish": _CONV_MOMENTS + _CONV_STORE + _CONV_STAGE,
        "mainloop_a_once": _CONV_A_ONCE + _CONV_MOMENTS + _CONV_STORE + _CONV_STAGE,
    }),
    # Whether the mainloop waits on its wgmmas or on its copies of x.
    "conv-mainloop": ("conv_sm90.cuh", {
        "tree": [],
        "no_wait": _CONV_WAIT,
        "a_once": _CONV_A_ONCE,
        "a_once_no_wait": _CONV_A_ONCE + _CONV_WAIT,
    }),
}


def edit_header(text: str, pairs: list[tuple[str, str]], header: str) -> str:
    """`text` with each (old, new) of `pairs` applied in order.

    Raises:
        ValueError: an `old` does not occur exactly once (in the text as edited so far).
    """
    for old, new in pairs:
        count = text.count(old)
        if count != 1:
            raise ValueError(f"{header}: {old!r} occurs {count} times, not once")
        text = text.replace(old, new)
    return text


def edited_include(root: Path, header: str, pairs: list[tuple[str, str]]) -> Path:
    """A copy of the project's include/ under `root` with `header` (a file name of
    include/fusedepi/) edited by `pairs`; its path."""
    from cuda_templates import compiler

    target = root / "include"
    shutil.copytree(compiler.INCLUDE_DIR, target)
    path = target / "fusedepi" / header
    if not path.is_file():
        raise ValueError(f"no header {header} in {compiler.INCLUDE_DIR / 'fusedepi'}")
    path.write_text(edit_header(path.read_text(), pairs, header))
    return target


def parse_variants(raw: list[list[str]]) -> dict[str, list[tuple[str, str]]]:
    """--variant NAME [OLD NEW]...: name -> the (old, new) pairs.

    Raises:
        ValueError: a variant with an OLD and no NEW, or a name given twice.
    """
    variants: dict[str, list[tuple[str, str]]] = {}
    for name, *rest in raw:
        if len(rest) % 2:
            raise ValueError(f"variant {name}: OLD NEW pairs, got {len(rest)} strings")
        if name in variants:
            raise ValueError(f"variant {name} given twice")
        variants[name] = list(zip(rest[::2], rest[1::2]))
    return variants


def chosen_variants(preset: str | None, raw: list[list[str]] | None, header: str
                    ) -> tuple[str, dict[str, list[tuple[str, str]]]]:
    """The header and the variants to run: the preset's (its header), then --variant's.

    Raises:
        ValueError: no variant at all, an unknown preset, or a name given twice.
    """
    variants: dict[str, list[tuple[str, str]]] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"no preset {preset!r} (presets: {', '.join(PRESETS)})")
        header, variants = PRESETS[preset][0], dict(PRESETS[preset][1])
    for name, pairs in parse_variants(raw or []).items():
        if name in variants:
            raise ValueError(f"variant {name} given twice")
        variants[name] = pairs
    if not variants:
        raise ValueError("no variant: give --preset or --variant")
    return header, variants


def parse_plan(raw: list[str] | None) -> dict:
    """--plan NAME=VALUE...: {name: value} for constants of `cuda_templates.conv_sm90`.

    Raises:
        ValueError: no '=', a name that is not an upper-case constant of conv_sm90, a
            value that is not a Python literal, or a name given twice.
    """
    from cuda_templates import conv_sm90

    plan = {}
    for item in raw or []:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not name.isupper() or not hasattr(conv_sm90, name):
            raise ValueError(f"--plan {item!r}: NAME=VALUE, NAME an upper-case constant of cuda_templates.conv_sm90")
        if name in plan:
            raise ValueError(f"--plan {name} given twice")
        try:
            plan[name] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"--plan {item!r}: the value is not a Python literal ({e})") from e
    return plan


def set_plan(plan: dict, set_constant=setattr) -> None:
    """Sets `cuda_templates.conv_sm90`'s constants as `plan` (`parse_plan`) names them,
    through `set_constant(module, name, value)`."""
    from cuda_templates import conv_sm90

    for name, value in plan.items():
        set_constant(conv_sm90, name, value)


def run_variant(include: Path | None, models: list[str], dtypes: list[str], kernels: str, calls: int,
                plan: dict | None = None) -> list[dict]:
    """In this process: each model compiled with fusedepi (kernels built from `include`,
    the tree's if None; conv_sm90's constants set as in `plan`), run, checked against
    float64 and timed."""
    os.environ["FUSEDEPI_AUTOTUNE"] = "off"
    import torch

    from cuda_templates import compiler

    set_plan(plan or {})

    from .compare import kernel_times
    from .once import model_and_input
    from .zoo import _max_error, _settings

    if include is not None:
        compiler.INCLUDE_DIR = include
    _settings()
    rows = []
    for name in models:
        for dtype_name in dtypes:
            torch._dynamo.reset()
            model, x = model_and_input(name, getattr(torch, dtype_name), train=True)
            fn = torch.compile(model, backend="fusedepi")
            with torch.no_grad():
                out = fn(x)
                ref = model.double()(x.double())
                model.to(getattr(torch, dtype_name))
                times = kernel_times(lambda: fn(x), calls)
            picked = [(ms, k) for ms, _, k in times if re.search(kernels, k)]
            rows.append({"model": name, "dtype": dtype_name, "error": _max_error(out, ref),
                         "kernels_us": sum(ms for ms, _ in picked) * 1000,
                         "all_us": sum(ms for ms, _, _ in times) * 1000,
                         "kernels": [k[:80] for _, k in picked]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--header", default="conv_sm90.cuh", help="the header of include/fusedepi/ to edit")
    parser.add_argument("--variant", nargs="+", action="append", metavar="NAME [OLD NEW]",
                        help="a variant: its name, then OLD NEW pairs (none: the tree's headers)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named set of variants (PRESETS), and its header")
    parser.add_argument("--models", nargs="+", required=True, help="zoo models or workloads")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float16",
                                                                                          "float32"])
    parser.add_argument("--kernels", default=FUSED_KERNELS, help="regex of the kernel names to sum")
    parser.add_argument("--plan", action="append", metavar="NAME=VALUE",
                        help="set a constant of cuda_templates.conv_sm90 (a Python literal) in every variant")
    parser.add_argument("--calls", type=int, default=20, help="calls the profiler averages over")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant from this JSON
    args = parser.parse_args(argv)
    if args.one:
        job = json.loads(args.one)
        include = Path(job["include"]) if job["include"] else None
        print(json.dumps(run_variant(include, args.models, args.dtypes, args.kernels, args.calls,
                                     parse_plan(args.plan))))
        return 0
    try:
        header, variants = chosen_variants(args.preset, args.variant, args.header)
        plan = parse_plan(args.plan)
        rows = []
        with tempfile.TemporaryDirectory(prefix="fusedepi-variants-") as tmp:
            for name, pairs in variants.items():
                include = str(edited_include(Path(tmp) / name, header, pairs)) if pairs else None
                cmd = [sys.executable, "-m", "benchmarks.kernel_variants", "--variant", name, "--models",
                       *args.models, "--dtypes", *args.dtypes, "--kernels", args.kernels, "--calls",
                       str(args.calls), "--one", json.dumps({"include": include})]
                cmd += [f"--plan={item}" for item in args.plan or []]
                run = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if run.returncode:
                    print(f"{name}: failed (exit {run.returncode}): {run.stderr.strip()[-800:]}", flush=True)
                    continue
                for row in json.loads(run.stdout.strip().splitlines()[-1]):
                    row["variant"] = name
                    row["plan"] = {k: repr(v) for k, v in plan.items()}
                    rows.append(row)
                    print(f"{name:16s} {row['model']:30s} {row['dtype']:9s} kernels {row['kernels_us']:9.1f} us  "
                          f"all {row['all_us']:9.1f} us  error {row['error']:.2e}", flush=True)
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "preset": args.preset, "plan": args.plan or [],
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
