"""The live-storage counter (``streaming_cache.train.memory_count``) on the meta device: exact byte counts of small
graphs worked out by hand, views counted once, freed tensors leaving the count, adapters' gradients counted, and
attention counted as the fused GPU kernels keep it (linear in the sequence) rather than as the math path does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streaming_cache.train.memory_count import Count, FusedAttention, LiveStorages, counting, module_tensors

F32 = 4
BF16 = 2


def _mlp(batch: int, d: int, h: int, o: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.empty(batch, d, device="meta")
    w1 = torch.empty(h, d, device="meta", requires_grad=True)
    w2 = torch.empty(o, h, device="meta", requires_grad=True)
    return x, w1, w2


def test_an_mlp_step_is_counted_to_the_byte():
    """``sum(linear(relu(linear(x, w1)), w2))`` with batch 8, widths 64 -> 1024 -> 16, fp32:

    * start: x, w1, w2;
    * forward peak: the first layer's output and the relu's output (which autograd keeps) both live;
    * after the forward pass: the relu's output (saved for both backward formulas) and the loss;
    * backward peak: w2's gradient, the gradient of the first layer's output and w1's gradient being made, with
      the loss and its seed gradient (the relu's output is freed once its node ran);
    * end: both weights' gradients."""
    b, d, h, o = 8, 64, 1024, 16
    x, w1, w2 = _mlp(b, d, h, o)
    start = (b * d + h * d + o * h) * F32
    with LiveStorages("meta", [x, w1, w2]) as c:
        loss = F.linear(F.relu(F.linear(x, w1)), w2).sum()
        c.mark("forward")
        loss.backward()
        c.mark("backward")
        del loss
    got = c.count()
    assert got.start == start
    assert c.marks["forward"] == (start + b * h * F32 + F32, start + 2 * b * h * F32)
    backward_peak = start + o * h * F32 + b * h * F32 + h * d * F32 + 2 * F32
    assert c.marks["backward"] == (start + (h * d + o * h) * F32 + F32, backward_peak)
    assert got == Count(start=start, peak=backward_peak, end=start + (h * d + o * h) * F32, found=0,
                        allocated=got.allocated)
    assert w1.grad is not None and w2.grad is not None


def test_frozen_weights_count_and_only_trained_tensors_get_gradients():
    """A frozen layer with a trained rank-4 adapter, as a LoRA step: the end holds the adapter's gradients only."""
    base = torch.nn.Linear(512, 512, bias=False, device="meta").requires_grad_(False)
    down = torch.empty(4, 512, device="meta", requires_grad=True)
    up = torch.empty(512, 4, device="meta", requires_grad=True)
    x = torch.empty(16, 512, device="meta")
    with counting(base, down, up, x, attention="math") as c:
        y = base(x) + F.linear(F.linear(x, down), up)
        y.sum().backward()
        del y
    got = c.storages.count()
    assert got.start == (512 * 512 + 2 * 4 * 512 + 16 * 512) * F32
    assert got.end - got.start == 2 * 4 * 512 * F32


def test_views_of_one_storage_count_once():
    with LiveStorages() as c:
        base = torch.empty(1000, device="meta")
        views = [base[10:], base.view(10, 100), base.view(100, 10).t(), base[::2], base.unsqueeze(0)]
    assert c.count().end == 1000 * F32 and c.count().peak == 1000 * F32
    assert len(views) == 5


def test_a_freed_temporary_leaves_the_count_but_sets_the_peak():
    with LiveStorages() as c:
        big = torch.empty(4096, device="meta")
        del big
        small = torch.empty(100, device="meta")
    got = c.count()
    assert (got.peak, got.end, got.allocated) == (4096 * F32, 100 * F32, (4096 + 100) * F32)
    assert small.numel() == 100


def test_a_storage_found_during_the_count_was_live_from_the_start():
    early = torch.empty(256, device="meta")
    with LiveStorages() as c:
        temp = torch.empty(1024, device="meta")
        del temp
        out = early + 1.0
    got = c.count()
    assert (got.start, got.found) == (256 * F32, 256 * F32)
    assert got.peak == (256 + 1024) * F32, "the peak before it was found includes it"
    assert got.end == (256 + 256) * F32
    assert out.shape == (256,)


def test_other_devices_are_not_counted():
    with LiveStorages("meta") as c:
        on_cpu = torch.empty(10_000)
        on_meta = torch.empty(10, device="meta")
    assert c.count().peak == 10 * F32
    assert on_cpu.numel() + on_meta.numel() == 10_010


def test_module_tensors_lists_shared_parameters_once():
    lin = torch.nn.Linear(8, 8, device="meta")
    model = torch.nn.Sequential(lin, lin)
    assert len(module_tensors(model, lin)) == 2


def _attention_step(length: int, attention: str, heads: int = 2, dim: int = 64) -> tuple[int, dict]:
    """The bytes an attention call's forward and backward pass add above q, k and v, and the kernels counted."""
    q, k, v = (torch.empty(1, heads, length, dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with counting(q, k, v, attention=attention) as c:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    return c.storages.count().transient, c.attention_calls()


def test_fused_attention_keeps_linear_memory_where_the_math_path_keeps_the_scores():
    """At 4096 and 8192 tokens: the fused count grows with the sequence, the math count with its square. Without
    the routing both would grow quadratically and the scores (64 MiB at 4096 tokens) would dominate."""
    heads, dim = 2, 64
    fused = {n: _attention_step(n, "flash", heads, dim) for n in (4096, 8192)}
    math_path = {n: _attention_step(n, "math", heads, dim)[0] for n in (4096, 8192)}
    assert fused[4096][1] == {"flash": 1, "efficient": 0, "math": 0}
    assert fused[8192][0] / fused[4096][0] == pytest.approx(2.0, rel=0.01)
    assert math_path[8192] / math_path[4096] == pytest.approx(4.0, rel=0.05)
    scores = heads * 4096 * 4096 * BF16
    assert math_path[4096] >= scores
    qkv = 3 * heads * 4096 * dim * BF16
    assert qkv <= fused[4096][0] <= 2 * qkv, "the inputs' gradients, the output, its gradient, the log-sum-exp"
    assert fused[4096][0] * 10 < scores


def test_the_fused_forward_keeps_the_output_and_one_logsumexp_per_query():
    heads, length, dim = 4, 2048, 128
    q, k, v = (torch.empty(1, heads, length, dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with counting(q, k, v) as c:
        out = F.scaled_dot_product_attention(q, k, v)
    extra = c.storages.count().end - c.storages.count().start
    kept = heads * length * dim * BF16 + heads * length * F32  # output, log-sum-exp (fp32)
    assert 0 <= extra - kept <= 64, "beyond these, only the kernel's random-number state (a few bytes)"
    assert out.shape == (1, heads, length, dim)


def test_masks_go_to_the_efficient_kernel_and_grouped_queries_to_the_math_path():
    mode = FusedAttention()
    q = torch.empty(1, 4, 256, 64, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(1, 2, 256, 64, device="meta", dtype=torch.bfloat16)
    mask = torch.empty(256, 256, device="meta", dtype=torch.bool)
    with mode:
        masked = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        grouped = F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        wide = F.scaled_dot_product_attention(*(torch.empty(1, 1, 8, 512, device="meta", dtype=torch.bfloat16),) * 3)
        fp32 = F.scaled_dot_product_attention(*(torch.empty(1, 1, 8, 64, device="meta"),) * 3)
    assert mode.calls == {"flash": 0, "efficient": 3, "math": 1}
    assert masked.shape == grouped.shape == q.shape and wide.shape[-1] == 512 and fp32.dtype == torch.float32


def test_counting_refuses_an_unknown_attention():
    with pytest.raises(ValueError, match="flash, math"):
        with counting(attention="sdpa"):
            pass
