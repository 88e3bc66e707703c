"""The decisions that branch on CUDA, executed on the CPU through a machine with fake GPUs
(``helpers/fake_cuda.py``): which optimizer step the weights get, which GPU each process of a multi-GPU training
selects (torchrun's ranks, the Train LoRA node's workers), and the attention settling call. ComfyUI's parts
(``training_clone``, the sampling tables' host copy, the node's worker GPUs) are in
``tests/comfy/test_device_paths.py``."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import train_worker  # scripts/

from helpers.fake_cuda import FakeCuda, fake_cuda_fixture  # noqa: F401
from streaming_cache import group, torch_build
from streaming_cache.train import optim, recompute

pytestmark = pytest.mark.oldest_torch

F32, BF16, F16, F64, I64 = torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64


def test_the_fixture_makes_a_machine_with_gpus_and_puts_torch_back(fake_cuda):
    before = (torch.cuda.is_available, torch.cuda.set_device, torch.version.hip)
    with FakeCuda(4, current=2) as fake:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 4 and torch.cuda.current_device() == 2
        torch.cuda.set_device("cuda:3")
        torch.cuda.set_device(torch.device("cuda", 1))
        assert fake.set_devices == [3, 1] and torch.cuda.current_device() == 1
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.cuda.set_device(4)
    assert (torch.cuda.is_available, torch.cuda.set_device, torch.version.hip) == before
    fake_cuda(2, rocm=True)
    assert torch.version.hip and torch.version.cuda is None and torch_build.is_rocm()
    fake_cuda(2)
    assert torch.version.cuda and not torch_build.is_rocm()


# ---- the fused optimizer step


@pytest.mark.parametrize("weights,rocm,fused", [
    ([("cuda", F32)] * 3, False, True),
    ([("cuda", BF16), ("cuda", F16), ("cuda", F64)], False, True),
    ([("cpu", F32)] * 3, False, None),
    ([("cuda", F32), ("cpu", F32)], False, None),  # mixed devices: PyTorch's default
    ([("cuda", F32), ("cuda", I64)], False, None),
    ([("cuda", torch.float8_e4m3fn)], False, None),  # floating point, but no fused kernel
    ([], False, None),
    ([("cuda", BF16)] * 2, True, True),  # ROCm: fused too (FUSED_ON_ROCM)
    ([("cuda", BF16), ("cpu", BF16)], True, None),
])
def test_fused_step_where_every_weight_is_a_floating_point_cuda_tensor(weights, rocm, fused):
    assert optim.fused_choice(weights, rocm) is fused


def test_the_optimizer_asks_the_platform_whether_it_is_rocm(fake_cuda, monkeypatch):
    """``_fused`` passes :func:`torch_build.is_rocm` to the decision: with ROCm's fused step switched off, a fake
    AMD machine takes the default and a fake NVIDIA one the fused step (the weights are CPU tensors here, which
    the decision is told to take as it takes CUDA ones)."""
    monkeypatch.setattr(optim, "FUSED_DEVICES", frozenset({"cuda", "cpu"}))
    groups = [{"params": [torch.zeros(2, requires_grad=True)]}]
    fake_cuda(1)
    assert optim._fused(groups) is True
    fake_cuda(1, rocm=True)
    assert optim._fused(groups) is True
    monkeypatch.setattr(optim, "FUSED_ON_ROCM", False)
    assert optim._fused(groups) is None
    fake_cuda(1)
    assert optim._fused(groups) is True


def test_adam_on_cpu_weights_gets_the_default_step():
    opt = optim.make_optimizer("AdamW", {"w": torch.zeros(2, requires_grad=True)}, 1e-3)
    assert opt.param_groups[0]["fused"] is None


# ---- multi-GPU device selection


@pytest.mark.parametrize("gpus", [2, 4])
def test_each_rank_selects_its_local_rank_th_gpu(fake_cuda, gpus):
    fake = fake_cuda(gpus)
    for local in range(2 * gpus):
        assert group.use_local_device({"LOCAL_RANK": str(local)}) == local % gpus
    assert fake.set_devices == [local % gpus for local in range(2 * gpus)]
    assert group.use_local_device({}) == 0, "LOCAL_RANK unset: the first GPU"


def test_a_process_that_sees_only_its_own_gpu_selects_it_whatever_its_local_rank(fake_cuda):
    fake = fake_cuda(1)
    assert [group.local_device(r) for r in range(4)] == [0, 0, 0, 0]
    group.use_local_device({"LOCAL_RANK": "3"})
    assert fake.set_devices == [0]


def test_without_cuda_no_device_is_selected_and_local_rank_is_not_read(fake_cuda):
    fake = fake_cuda(0)
    assert group.local_device(3) is None
    assert group.use_local_device({"LOCAL_RANK": "not a number"}) is None
    assert fake.set_devices == []


def test_torchrun_ranks_select_their_gpu_before_joining(fake_cuda, monkeypatch):
    """``init_from_env`` (what ``scripts/headless.py`` runs under torchrun): the rank's GPU is current before
    the group is joined, with NCCL on GPUs and gloo without."""
    joined = []
    monkeypatch.setattr(group.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(group.dist, "init_process_group", lambda backend, timeout: joined.append(backend))
    monkeypatch.setattr(group.Group, "current", classmethod(lambda cls: None))
    monkeypatch.setenv("WORLD_SIZE", "4")
    for gpus, local, backend in ((4, "3", "nccl"), (2, "3", "nccl"), (0, "3", "gloo")):
        fake = fake_cuda(gpus)
        monkeypatch.setenv("LOCAL_RANK", local)
        group.init_from_env()
        assert fake.set_devices == ([int(local) % gpus] if gpus else [])
        assert joined.pop() == backend


def test_the_groups_collectives_use_the_current_gpu_with_nccl(fake_cuda, monkeypatch):
    fake_cuda(4, current=2)
    monkeypatch.setattr(group.dist, "get_backend", lambda: "nccl")
    assert group.Group(1, 2, 2).device() == torch.device("cuda", 2)
    monkeypatch.setattr(group.dist, "get_backend", lambda: "gloo")
    assert group.Group(1, 2, 2).device() == torch.device("cpu")


@pytest.mark.parametrize("gpus,mine,devices,expected", [
    (2, 0, 2, [1]),
    (2, 1, 2, [0]),
    (4, 0, 4, [1, 2, 3]),
    (4, 2, 3, [0, 1]),
    (4, 3, 2, [0]),
])
def test_the_node_gives_each_worker_another_gpu_and_the_worker_selects_it(fake_cuda, gpus, mine, devices, expected):
    """The node (``nodes/workers.py``) keeps ComfyUI's GPU and hands the others out; each worker, started with the
    environment the node gives it, selects its GPU (``scripts/train_worker.py``), so every rank is on its own."""
    fake = fake_cuda(gpus, current=mine)
    assert group.worker_gpus(devices, mine) == expected
    envs = group.worker_environments(expected, 29500, timedelta(seconds=60))
    assert [envs[i]["RANK"] for i in range(len(expected))] == [str(r) for r in range(1, devices)]
    assert {e["WORLD_SIZE"] for e in envs.values()} == {str(devices)}
    selected = []
    for env in envs.values():
        selected.append(group.use_local_device(env))
    assert selected == expected == fake.set_devices
    assert sorted([mine, *selected]) == sorted(set([mine, *selected])), "two ranks on one GPU"


def test_a_worker_script_selects_the_gpu_its_local_rank_names(fake_cuda, monkeypatch):
    fake = fake_cuda(4)
    for local in ("2", "0", "3"):
        monkeypatch.setenv("LOCAL_RANK", local)
        assert train_worker.use_gpu() == int(local)
    assert fake.set_devices == [2, 0, 3]


@pytest.mark.parametrize("gpus,mine,devices", [(2, 0, 3), (4, 1, 5), (1, 0, 2)])
def test_too_few_gpus_for_devices_is_refused_saying_what_to_change(fake_cuda, gpus, mine, devices):
    fake_cuda(gpus)
    with pytest.raises(ValueError) as error:
        group.worker_gpus(devices, mine)
    assert str(error.value) == (f"devices is {devices} but this machine has {gpus} GPU(s) visible to ComfyUI; "
                                "lower devices (or start ComfyUI without --cuda-device)")


def test_comfyui_on_the_cpu_starts_workers_on_the_cpu(fake_cuda):
    fake_cuda(4)
    gpus = group.worker_gpus(3, None)
    assert gpus == [None, None]
    assert [e["LOCAL_RANK"] for e in group.worker_environments(gpus, 1, timedelta(seconds=1)).values()] == ["0", "1"]


# ---- the attention settling call


class _Recorded:
    """Where the settling call makes its tensors (a CPU tensor stands in), and the attention calls made."""

    def __init__(self, monkeypatch) -> None:
        self.made: list[torch.device] = []
        self.calls: list[tuple[torch.Tensor, ...]] = []
        self.queries: list[torch.Tensor] = []
        attention = torch.nn.functional.scaled_dot_product_attention

        def make(device: torch.device) -> torch.Tensor:
            self.made.append(device)
            self.queries.append(torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16))
            return self.queries[-1]

        def sdpa(*args, **kwargs):
            self.calls.append(args)
            return attention(*args, **kwargs)

        monkeypatch.setattr(recompute, "_settling_query", make)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        monkeypatch.setattr(recompute, "_settled", set())


@pytest.mark.parametrize("rocm", [False, True])
def test_attention_is_settled_once_per_gpu_and_never_on_the_cpu(fake_cuda, monkeypatch, rocm):
    fake_cuda(2, rocm=rocm, current=1)
    seen = _Recorded(monkeypatch)
    assert not recompute.settle_attention_dispatch(torch.device("cpu"))
    assert seen.made == [] and seen.calls == []
    assert recompute.settle_attention_dispatch(torch.device("cuda", 1))
    assert seen.made == [torch.device("cuda", 1)]
    assert len(seen.calls) == 1 and all(t is seen.queries[0] for t in seen.calls[0]), "attention on that tensor"
    assert not recompute.settle_attention_dispatch(torch.device("cuda"))  # the current device: 1, settled
    assert not recompute.settle_attention_dispatch(torch.device("cuda", 1))
    assert recompute.settle_attention_dispatch(torch.device("cuda", 0))
    assert seen.made == [torch.device("cuda", 1), torch.device("cuda", 0)] and len(seen.calls) == 2
    assert not recompute.settle_attention_dispatch(torch.device("cuda", 0))
    assert len(seen.calls) == 2


def test_attention_on_a_device_without_an_index_settles_the_current_gpu(fake_cuda, monkeypatch):
    fake_cuda(4, current=3)
    seen = _Recorded(monkeypatch)
    assert recompute.settle_attention_dispatch(torch.device("cuda"))
    assert seen.made == [torch.device("cuda", 3)]
    assert not recompute.settle_attention_dispatch(torch.device("cuda", 3))
