"""linear_cross_entropy with a sharded LM head (fastce_torch/distributed/linear_sharded.py) against the float64
reference of shared_tests/test_linear_cross_entropy.py: each test launches `linear_parallel_check` under
torch.distributed.run, gloo processes on the CPU, or, with --gpu, NCCL over two GPUs at mid shapes.

- tp: a column-parallel head through process_group= (2 ranks: equal slices; 3 ranks: V = 130 split 44/43/43 with
  vocab_start=).
- dtensor-tp: hidden a Replicate DTensor, weight and bias Shard(0) DTensors (3 ranks: Shard's uneven chunking).
- fsdp: the weight a Shard(0) DTensor as FSDP2's fully_shard leaves it, each rank its own rows; then a real
  fully_shard(lm_head) model against calling lm_head and cross_entropy.
The plain-torch backend checks the sharding logic over every case; the kernel backend (Triton's interpreter on the
CPU, slow) a few.
"""

import pytest
import torch

from .test_sharding import run_ranks, segments

pytestmark = pytest.mark.slow  # each test runs gloo processes under torch.distributed.run

MODULE = "fastce_torch.tests.linear_parallel_check"
KERNEL_CASES = "--only=mean-bias,none-all-options,smoothing-zloss,bad-label-none,ignore-7-sum-n_items"


@pytest.mark.parametrize("n_ranks", [2, 3])
def test_ranks(n_ranks):
    # One launch per rank count (`--then` between the argument sets): the plain-torch backend in every mode, then
    # the kernels (2 ranks: tp and fsdp; 3 ranks: tp on V = 130 split 44/43/43).
    reference = [["--backend=reference", f"--mode={mode}"] for mode in ("tp", "dtensor-tp", "fsdp")]
    if n_ranks == 2:
        kernel = [["--backend=kernel", f"--mode={mode}", KERNEL_CASES] for mode in ("tp", "fsdp")]
    else:
        kernel = [["--backend=kernel", "--mode=tp", "--only=none-all-options,mean-bias"]]
    run_ranks(n_ranks, *segments(*reference, *kernel, common=["--device=cpu"]), module=MODULE)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["tp", "dtensor-tp", "fsdp"])
def test_two_gpus_nccl_linear(mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    run_ranks(2, "--device=cuda", "--backend=kernel", f"--mode={mode}", "--size=mid", module=MODULE)
    run_ranks(2, "--device=cuda", "--backend=kernel", f"--mode={mode}", module=MODULE)


def test_arguments():
    import fastce_torch

    hidden, weight, labels = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 4, 2])
    with pytest.raises(ValueError, match="vocab_start"):
        fastce_torch.linear_cross_entropy(hidden, weight, labels, vocab_start=5)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            fastce_torch.linear_cross_entropy(hidden, weight, labels, process_group=object())
