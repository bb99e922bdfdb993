"""The `fusedepi` torch.compile backend: Inductor, with our chains rewritten first.

Inductor's `compile_fx` runs AOTAutograd with Inductor's decompositions minus
`lowering.HELD_BACK_OPS`, so the matcher sees those ops whole. Our inner compile
step rewrites matched chains into fused ops, decomposes whatever held-back ops
remain, and hands the graph to Inductor's own inner compile.
"""

from __future__ import annotations

import functools
import logging
import threading
from contextlib import contextmanager

import torch
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._guards import detect_fake_mode
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from lowering import HELD_BACK_OPS

from .config import Config, load_config
from .rewrite import Report, rewrite

log = logging.getLogger("fusedepi")

# Where fusion reports go while `collect_reports` is active. Process-wide, not
# per-thread: Dynamo and Inductor may compile on a thread other than the caller's.
_sinks: list = []
_sinks_lock = threading.Lock()


def _overloads(packets):
    return {getattr(p, name) for p in packets for name in p.overloads()}


@functools.lru_cache(maxsize=1)
def _tables():
    """(Inductor's table without the held-back ops, the held-back decompositions)."""
    table = dict(select_decomp_table())
    held = {op: table.pop(op) for op in _overloads(HELD_BACK_OPS) if op in table}
    return table, held


def _decompose_held_back(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Applies Inductor's decompositions to held-back ops that were not fused.

    The whole table, not only the held-back entries: a decomposition may emit ops
    (logsumexp -> masked_fill) that Inductor expects decomposed in turn.
    """
    _, held = _tables()
    if not any(n.op == "call_function" and n.target in held for n in gm.graph.nodes):
        return gm
    fake_mode = detect_fake_mode(example_inputs)
    with fake_mode:
        return make_fx(gm, decomposition_table=select_decomp_table(), tracing_mode="real")(*example_inputs)


@contextmanager
def collect_reports(into: list):
    """Collects the `Report` of every graph compiled while active (for `explain`)."""
    with _sinks_lock:
        _sinks.append(into)
    try:
        yield into
    finally:
        with _sinks_lock:
            _sinks.remove(into)


def _inner_compile(gm, example_inputs, *, cfg: Config, **kwargs):
    if not kwargs.get("is_backward", False):
        report = rewrite(gm, cfg)
        with _sinks_lock:
            for sink in _sinks:
                sink.append(report)
    gm = _decompose_held_back(gm, example_inputs)
    return compile_fx_inner(gm, example_inputs, **kwargs)


def _configure_logging(cfg: Config):
    logger = logging.getLogger("fusedepi")
    logger.setLevel(cfg.log_level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)


def _inductor_patches(mode, options) -> dict:
    """Inductor config for `torch.compile(..., mode=..., options=...)`, as Inductor reads them.

    Raises:
        RuntimeError: an unknown mode or option name (Inductor's own message).
    """
    from torch._inductor import list_mode_options, list_options

    patches = dict(list_mode_options(mode)) if mode else {}
    if options:
        known = set(list_options())
        unknown = sorted(k for k in options if k not in known)
        if unknown:
            raise RuntimeError(f"fusedepi: unknown Inductor options {unknown} (see torch._inductor.list_options())")
        patches.update(options)
    return patches


def fusedepi(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None, **kwargs):
    """The torch.compile backend: `torch.compile(model, backend="fusedepi")`.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        mode: `torch.compile`'s mode, applied to Inductor as Inductor applies it
            ("reduce-overhead": CUDA graphs; the fused ops are capturable).
        options: `torch.compile`'s options, Inductor config entries.
        **kwargs: passed to Inductor's `compile_fx` (e.g. `config_patches`).
    """
    cfg = load_config()
    _configure_logging(cfg)
    patches = _inductor_patches(mode, options)
    if patches:
        kwargs["config_patches"] = {**patches, **kwargs.get("config_patches", {})}
    if cfg.disable_all:
        return compile_fx(gm, example_inputs, **kwargs)
    table, _ = _tables()
    # AOTAutograd's cache is keyed on the graph before our rewrite: a hit would hand
    # back whatever plain Inductor compiled for it. Inductor's FX graph cache stays on;
    # its key is the rewritten graph, which carries our specs.
    # Shape padding pads a matmul and slices its output when a microbenchmark says the
    # padded one is faster, so whether a chain starts with a bare addmm would vary
    # from run to run (seen: bf16 [14, 64] x [64, 96] + LayerNorm refused as
    # "slice.Tensor is not in the vocabulary" in one run of three).
    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(shape_padding=False):
        return compile_fx(
            gm,
            example_inputs,
            inner_compile=functools.partial(_inner_compile, cfg=cfg),
            decompositions=table,
            **kwargs,
        )


__all__ = ["Report", "collect_reports", "fusedepi"]
