"""GPU-free: the zoo's models build and run (one sample each), fuse their whole chains (through the
fused op's reference), and the command line lists them."""

import subprocess
import sys

import pytest
import torch

from benchmarks import zoo


def test_the_zoo_has_forty_models_of_distinct_names():
    assert len(zoo.MODELS) >= 40 and len(zoo.BY_NAME) == len(zoo.MODELS)
    assert set(zoo.QUICK) <= set(zoo.BY_NAME)


@pytest.mark.parametrize("name", list(zoo.BY_NAME))
def test_each_model_runs_one_sample(name):
    model = zoo.BY_NAME[name].make()
    x = torch.rand((2,) + zoo.BY_NAME[name].shape[1:])  # two: BatchNorm in training needs them
    with torch.no_grad():
        out = model(x)
    assert torch.isfinite(out).all()


def test_list_prints_one_name_a_line():
    out = subprocess.run([sys.executable, "-m", "benchmarks.zoo", "--list"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == list(zoo.BY_NAME)


# Zoo models with a chain that does not fuse whole, with the reason it stops or is refused.
PARTIAL = {
    "conv2d_gn_gelu_global_mean": "spatial_mean: only one reduction per fused kernel",
    "se_conv_block": "spatial_mean: only one reduction per fused kernel",  # and its gate is the chain's own
    "unet_resblock_time_embedding": "of shape [2, 128, 1, 1] is neither per-channel",  # a value per (image, channel)
    "convnext_block": "permute.default is not in the vocabulary",  # LayerNorm over channels moved last
}
# Where a chain may end and still be whole: the graph's output, or the next matrix op.
WHOLE = ("end of the graph", "is the next matrix op")


@pytest.mark.parametrize("name", list(zoo.BY_NAME))
def test_each_model_fuses_its_whole_chain(name, cpu_reference):
    """Every zoo model's chains fuse to their end (through the fused op's reference on the
    CPU, at batch 2), but those PARTIAL names with the reason, and the model still
    computes what eager computes."""
    from helpers import compile_records

    torch.manual_seed(0)
    model = zoo.BY_NAME[name].make()
    x = torch.rand((2,) + zoo.BY_NAME[name].shape[1:])
    with torch.no_grad():
        out, fused, refused = compile_records(model, x)
        expected = model(x)
    assert fused or name in PARTIAL, [r.reason for r in refused]
    stops = [r.stop for r in fused] + [r.reason for r in refused]
    if name in PARTIAL:
        assert any(PARTIAL[name] in stop for stop in stops), stops
    else:  # (a refusal: the Linear that computes a bmm's operand)
        assert all(stop.startswith(WHOLE[0]) or WHOLE[1] in stop for stop in stops), stops
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
