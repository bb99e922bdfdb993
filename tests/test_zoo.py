"""GPU-free: the zoo's models build and run (one sample each), and its command line lists them."""

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
