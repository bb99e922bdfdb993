"""GPU tier, two GPUs: DistributedDataParallel with torch.compile(backend="fusedepi").

Two processes (NCCL), each training the same model with DDP on its own data, once
uncompiled and once compiled by fusedepi (Dynamo splits the graph at DDP's bucket
boundaries); the losses and the parameters after 10 SGD steps must agree.
Skipped on hosts with fewer than two GPUs.
"""

import copy
import json
import os
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]
STEPS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(model, fn, batches, target):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x in batches:
        loss = (fn(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _worker(rank: int, world: int, port: int, out_dir: str):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.workloads import LinearGroupNormLeakyDouble
    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        torch.set_float32_matmul_precision("highest")
        torch.manual_seed(0)
        base = LinearGroupNormLeakyDouble(256, 512, 32).cuda(rank)
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        batches = [torch.rand(64, 256, generator=gen).cuda(rank) for _ in range(STEPS)]
        target = torch.full((64, 512), 0.25, device=f"cuda:{rank}")
        plain = DDP(copy.deepcopy(base), device_ids=[rank])
        fused = DDP(copy.deepcopy(base), device_ids=[rank])
        reports: list = []
        with collect_reports(reports):
            compiled = torch.compile(fused, backend=fusedepi)
            fused_losses = _train(fused, compiled, batches, target)
        plain_losses = _train(plain, plain, batches, target)
        diffs = [(a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
                 for a, b in zip(fused.parameters(), plain.parameters())]
        records = [r for rep in reports for r in rep.records if r.status == "fused"]
        checksum = sum(p.double().sum().item() for p in fused.parameters())
        result = {"fused": [r.fusion for r in records], "fused_losses": fused_losses,
                  "plain_losses": plain_losses, "param_rel_diff": max(diffs), "checksum": checksum}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_ddp_losses_match_uncompiled_ddp(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, res in enumerate(results):
        assert "linear_groupnorm" in res["fused"], res["fused"]
        for step, (a, b) in enumerate(zip(res["fused_losses"], res["plain_losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} vs {b}"
        assert res["param_rel_diff"] <= 1e-5, res["param_rel_diff"]
    # DDP kept the compiled replicas in step: both ranks hold the same parameters.
    assert results[0]["checksum"] == results[1]["checksum"]
    print("DDP losses (rank 0, fused / plain):", results[0]["fused_losses"], results[0]["plain_losses"])
