"""gemcompile::sparse_embedding_bags on CUDA: the one-launch Triton forward against each table's own
nn.EmbeddingBag CUDA kernel (same fp32 summation order: sums equal in fp32, means within one rounding of
the division), and an id outside its table raised as a device-side assert (checked in a child process: the
assert ends the CUDA context)."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gemcompile.lowering.sparse_embedding.bags import sparse_embedding_bags
from gemcompile.lowering.sparse_embedding.op import MODE_MEAN, MODE_SUM

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("tables,rows,dim,bags,hot", [(64, 1 << 17, 128, 256, 16), (5, 1000, 33, 7, 3),
                                                      (3, 50, 256, 1024, 1)])
@pytest.mark.parametrize("mode", [MODE_SUM, MODE_MEAN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_each_tables_embedding_bag(tables, rows, dim, bags, hot, mode, dtype):
    g = torch.Generator(device="cuda").manual_seed(tables + dim)
    weights = [torch.randn(rows, dim, device="cuda", generator=g).to(dtype) for _ in range(tables)]
    batch = torch.randint(0, rows, (bags, tables, hot), device="cuda", generator=g)
    batch[::3, :, -1] = 0  # padding ids
    ids = batch.transpose(0, 1)  # strided, as model code slices features
    got = sparse_embedding_bags(ids, weights, torch.zeros(1, dtype=torch.int64, device="cuda"), mode, 0,
                                list(range(tables)))
    bag_mode = "mean" if mode == MODE_MEAN else "sum"
    want = torch.stack([F.embedding_bag(ids[t], w, mode=bag_mode, padding_idx=0) for t, w in enumerate(weights)])
    if dtype == torch.float32 and mode == MODE_SUM:
        assert torch.equal(got, want)
    elif dtype == torch.float32:  # H200, torch 2.11: torch's mean differs from sum / count in the last bit
        torch.testing.assert_close(got, want, rtol=2.5e-7, atol=1e-7)
    else:  # torch's bf16 bag kernel accumulates in fp32 too; one rounding at the end either way
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_an_id_outside_its_table_is_a_device_assert():
    code = ("import torch\n"
            "from gemcompile.lowering.sparse_embedding.bags_triton import embedding_bags_triton\n"
            "w = [torch.zeros(7, 8, device='cuda'), torch.zeros(100, 8, device='cuda')]\n"
            "ids = torch.ones(2, 4, 3, dtype=torch.int64, device='cuda'); ids[0, 1, 2] = 50\n"
            "embedding_bags_triton(ids, w, False, 0); torch.cuda.synchronize()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "device-side assert" in done.stderr, done.stderr[-2000:]
