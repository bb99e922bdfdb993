"""fusedepi: a torch.compile backend that fuses matmul/conv epilogues into CUDA kernels.

`torch.compile(model, backend="fusedepi")` (registered through the
`torch_dynamo_backends` entry point) or `torch.compile(model, backend=fusedepi)`.
"""

from . import launch, ops  # register torch.ops.fusedepi.chain (ops) and its CUDA implementation (launch)
from .backend import fusedepi
from .config import Config, load_config
from .explain import ExplainReport, explain
from .rewrite import FusionError

__all__ = ["Config", "ExplainReport", "FusionError", "explain", "fusedepi", "launch", "load_config", "ops"]
