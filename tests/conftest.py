import pytest
import torch

# Test ids of torch dtypes: short names none of which holds another, so that `-k bf16`
# or `-k "not fp16"` selects what it says (str() gave "torch.bfloat16", which holds "float16").
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def pytest_make_parametrize_id(config, val, argname):
    return DTYPE_IDS.get(val) if isinstance(val, torch.dtype) else None


@pytest.fixture
def count_builds(monkeypatch):
    """Records every kernel build (one nvcc run each) in this process; yields the list of sources."""
    from cuda_templates import compiler

    calls = []
    real = compiler._ninja_build

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "_ninja_build", counting)
    return calls


@pytest.fixture(autouse=True, scope="session")
def conv_plan_of_the_run():
    """conv_sm90's constants as FUSEDEPI_TEST_CONV_PLAN names them, for the whole run
    (tests/conv_plan.py); none where it is unset."""
    import conv_plan

    with pytest.MonkeyPatch.context() as patch:
        conv_plan.apply_from_env(patch.setattr)
        yield


@pytest.fixture(autouse=True)
def untimed_chains(monkeypatch):
    """Every matched chain is fused, untimed (FUSEDEPI_AUTOTUNE=off): the tests check the
    kernels and the rewrite; tests/test_choice.py checks the measured choice itself."""
    monkeypatch.setenv("FUSEDEPI_AUTOTUNE", "off")


@pytest.fixture
def cpu_reference(monkeypatch):
    """Lets the backend fuse CPU graphs (the fused op then runs its torch reference)."""
    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run the I-th of N parts of the collected tests (every N-th, from the I-th; I from 1), "
                          "so that a tier too long for one call runs in N")


def _shard(value: str) -> tuple[int, int]:
    try:
        i, n = (int(part) for part in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {value}: expected I/N, e.g. 1/2") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard {value}: I runs from 1 to N")
    return i, n


def pytest_collection_modifyitems(config, items):
    if config.getoption("--shard"):
        i, n = _shard(config.getoption("--shard"))
        config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % n != i - 1])
        items[:] = [item for k, item in enumerate(items) if k % n == i - 1]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
