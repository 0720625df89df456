"""CUDA tensors: over NCCL (one GPU per rank) and over gloo (staged through host memory)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ring_launch import launch

from aggregation.ring import ALGORITHMS, allreduce

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _check_cuda(rank: int, n: int) -> list[str]:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    fails = []
    for length in (0, 7, 2**20 + 3):
        for dtype in (torch.float32, torch.float16, torch.int32):
            g = torch.Generator().manual_seed(rank * 100 + length)
            x = (torch.randn(length, generator=g) * 100).to(dtype).cuda()
            ref = x.clone()
            dist.all_reduce(ref)
            for alg in ALGORITHMS:
                got = allreduce(x, algorithm=alg, timeout=60)
                ok = (torch.equal(got, ref) if not dtype.is_floating_point
                      else torch.allclose(got.double(), ref.double(), rtol=1e-2, atol=1e-1))
                if not ok or got.device != x.device:
                    fails.append(f"{alg}/{dtype}/L={length}")
    return fails


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_cuda_tensors_over_nccl() -> None:
    assert launch(_check_cuda, 2, backend="nccl", timeout=300) == [[], []]


def test_cuda_tensors_over_gloo() -> None:
    assert launch(_check_cuda, 2, backend="gloo", timeout=300) == [[], []]
