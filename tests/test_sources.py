"""GPU-free checks of the sources themselves: no module defines a top-level name twice
(a second `class` or `def` of one name silently replaces the first for every caller that
looks it up at run time, as the GPU tier's model tables do), and those tables build their
models."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("fusion_backend", "lowering", "cuda_templates", "benchmarks", "tests")
                 for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_top_level_function_or_class_is_defined_twice(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    seen: dict[str, int] = {}
    twice = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                twice.append(f"{node.name}: lines {seen[node.name]} and {node.lineno}")
            seen[node.name] = node.lineno
    assert not twice, twice


def test_the_gpu_tiers_model_tables_build_their_models():
    """Every entry of tests/test_gpu.py's tables that starts with a builder (a function of
    no arguments: a model, or a bmm's weight) builds on the CPU, with the names the
    builders find when the tests run."""
    import inspect

    import test_gpu

    built = 0
    for name, table in vars(test_gpu).items():
        if not (name.isupper() and isinstance(table, dict)):
            continue
        for key, entry in table.items():
            builder = entry[0] if isinstance(entry, tuple) and entry else None
            if inspect.isfunction(builder) and not inspect.signature(builder).parameters:
                assert builder() is not None, (name, key)
                built += 1
    assert built >= 100, built
