import pytest
import torch


@pytest.fixture
def cpu_reference(monkeypatch):
    """Lets the backend fuse CPU graphs (the fused op then runs its torch reference)."""
    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
