"""Few-row float32 products as tall GEMMs (models.skinny): same results as nn.Linear, applied where configured."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specpolicy.models import RandomInitSource
from specpolicy.models.draft import FreshDraft, LayerSubsetDraft
from specpolicy.models.skinny import MAX_ROWS, SkinnyLinear, linear, use_skinny_gemm
from specpolicy.models.vocab import use_subset_head

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (1, 1, 24), (3, 5, 24), (MAX_ROWS, 24), (MAX_ROWS + 1, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_for_any_number_of_rows(shape: tuple[int, ...], bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(*shape, generator=gen), torch.randn(40, 24, generator=gen)
    b = torch.randn(40, generator=gen) if bias else None
    out = linear(x, weight, b)
    assert out.shape == (*shape[:-1], 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_few_rows_take_the_tall_gemm_and_the_rest_keep_f_linear() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=gen)
    few, one = torch.randn(3, 24, generator=gen), torch.randn(1, 24, generator=gen)
    assert torch.equal(linear(few, weight), torch.mm(weight, few.T).T)
    assert torch.equal(linear(one, weight), torch.mm(weight, one.repeat(2, 1).T).T[:1])  # a lone row is doubled
    many = torch.randn(MAX_ROWS + 1, 24, generator=gen)
    assert torch.equal(linear(many, weight), F.linear(many, weight))
    half = few.bfloat16()
    assert torch.equal(linear(half, weight.bfloat16()), F.linear(half, weight.bfloat16()))


def test_gradients_flow_through_the_tall_gemm() -> None:
    layer = use_skinny_gemm(torch.nn.Linear(8, 4))
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(2, -1))
    assert layer.weight.grad is not None and layer.bias.grad is not None


def test_sources_apply_it_when_configured_and_built_drafts_follow_their_target() -> None:
    plain = RandomInitSource(config=TINY, device="cpu", skinny_gemm=False).load()
    skinny = RandomInitSource(config=TINY, device="cpu").load()
    linears = [m for m in plain.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and not any(isinstance(m, SkinnyLinear) for m in linears)
    assert all(isinstance(m, SkinnyLinear) for m in skinny.model.modules() if isinstance(m, torch.nn.Linear))
    assert skinny.model.state_dict().keys() == plain.model.state_dict().keys()
    half = RandomInitSource(config=TINY, device="cpu", dtype="bfloat16").load()  # its own kernels are flat already
    assert not any(isinstance(m, SkinnyLinear) for m in half.model.modules())
    ids = torch.tensor([[5, 9, 2, 7]])
    for step in (ids, ids[:, :1]):  # a prompt, and a single token
        torch.testing.assert_close(skinny.model(step).logits, plain.model(step).logits, rtol=1e-4, atol=1e-4)

    for build in (LayerSubsetDraft(layers=[0, -1]), FreshDraft(num_hidden_layers=1)):
        for target, expected in ((skinny, True), (plain, False)):
            draft = build.build(target).model
            assert any(isinstance(m, SkinnyLinear) for m in draft.modules()) is expected
    draft = LayerSubsetDraft(layers=[0, -1]).build(skinny)
    use_subset_head(draft, torch.arange(32))
    assert isinstance(draft.model.get_output_embeddings().subset, SkinnyLinear)
