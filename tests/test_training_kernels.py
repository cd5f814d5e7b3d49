"""The trainer's fused kernels (`tandem.kernels.training`) against the PyTorch model's ops, forward and backward:
each op alone in fp32 and bf16, then a whole model's loss and every parameter's gradient. Without CUDA the
kernels run under Triton's CPU interpreter, so the shapes stay small."""

import pytest
import torch
from hf_ref import hf_model, tandem_twin

pytest.importorskip("triton")

from tandem.config import ModelConfig  # noqa: E402
from tandem.kernels import training  # noqa: E402
from tandem.model.attention import PackedCausal  # noqa: E402
from tandem.model.qwen3 import RMSNorm, apply_rope, rope_cos_sin, silu_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def grads(fn, inputs, dy):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*inputs)
    y.backward(dy)
    return y.detach(), [t.grad for t in inputs]


def assert_same(fused, reference, dtype):
    (y, gs), (y_ref, gs_ref) = fused, reference
    torch.testing.assert_close(y.float(), y_ref.float(), **TOLERANCE[dtype])
    for g, g_ref in zip(gs, gs_ref, strict=True):
        assert g.dtype == g_ref.dtype
        torch.testing.assert_close(g.float(), g_ref.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 64), (23, 16)], ids=str)  # 23 rows: programs loop over rows
def test_rmsnorm_forward_and_backward(dtype, shape, monkeypatch):
    monkeypatch.setattr(training, "MAX_PROGRAMS", 4)  # (few programs, each looping over rows, as over 512 rows)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(DEVICE, dtype)
    norm = RMSNorm(shape[-1], 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    dy = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    reference = grads(lambda x, w: norm.weight.new_tensor(0) + torch.func.functional_call(norm, {"weight": w}, x),
                      [x, norm.weight], dy)
    fused = grads(lambda x, w: training.rmsnorm(x, w, 1e-6), [x, norm.weight], dy)
    assert_same(fused, reference, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [(3, 64), (1, 128), (2, 80), (1, 96)])  # (80, 96: padded halves)
def test_rope_forward_and_backward(dtype, heads, head_dim):
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 2, 7, 300, 5]).to(DEVICE)
    cos, sin = rope_cos_sin(positions, head_dim, 1e6)
    x = torch.randn(6, heads, head_dim, generator=gen).to(DEVICE, dtype)
    dy = torch.randn(6, heads, head_dim, generator=gen).to(DEVICE, dtype)
    assert_same(grads(lambda x: training.apply_rope(x, cos, sin), [x], dy),
                grads(lambda x: apply_rope(x, cos, sin), [x], dy), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_forward_and_backward(dtype):
    gen = torch.Generator().manual_seed(2)
    gate, up, dy = ((torch.randn(4, 1100, generator=gen) * 4).to(DEVICE, dtype) for _ in range(3))  # 2 blocks/row
    assert_same(grads(training.silu_mul, [gate, up], dy), grads(silu_mul, [gate, up], dy), dtype)


def test_model_loss_and_every_gradient_equal_the_pytorch_model():
    """A two-layer model, fp32, packed sequences: the loss and each parameter's gradient, kernels against not."""
    config = ModelConfig(vocab_size=200, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    reference = tandem_twin(hf_model(config), config).to(DEVICE)
    fused = tandem_twin(hf_model(config), config).to(DEVICE).use_training_kernels()
    assert fused.model.layers[0].self_attn.rope is training.apply_rope
    lens = [5, 9, 1]
    ids = torch.randint(0, config.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    losses = []
    for model in (reference, fused):
        logits = model.compute_logits(model(ids, positions, PackedCausal(lens)))
        loss = torch.nn.functional.cross_entropy(logits[:-1], ids[1:])
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for (name, p), (_, q) in zip(reference.named_parameters(), fused.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
