"""Every distillation config composes and instantiates; drafts built from the target have the promised shape."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from specpolicy.distill import losses
from specpolicy.errors import SpecPolicyError
from specpolicy.models import RandomInitSource
from specpolicy.models.draft import FreshDraft, describe_cost

CONF = Path(__file__).resolve().parents[1] / "conf"


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=["debug=fast", "experiment=tiny", *overrides])


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "tvd", "jsd"])
def test_each_loss_config_is_a_divergence(loss):
    """Each YAML builds its own divergence: zero at p = q, and for p != q exactly the function it names (a
    config pointing at another divergence, or a loss that is always 0, would pass the first check alone)."""
    fn = instantiate(_compose(f"distill/loss={loss}").distill.loss)
    g = torch.Generator().manual_seed(0)
    p, q = (torch.log_softmax(torch.randn(3, 11, generator=g), -1) for _ in range(2))
    assert fn(q, q).shape == (3,) and fn(q, q).abs().max() < 1e-6
    assert torch.allclose(fn(p, q), getattr(losses, loss)(p, q)) and bool((fn(p, q) > 0).all())
    others = {name for name in ("forward_kl", "reverse_kl", "tvd", "jsd") if name != loss}
    assert not any(torch.allclose(fn(p, q), getattr(losses, other)(p, q)) for other in others)


@pytest.mark.parametrize("trainer", ["default", "cpu", "gpu", "ddp"])
def test_trainer_and_callback_configs_compose(trainer):
    cfg = _compose(f"trainer={trainer}", "distill=lora")
    assert cfg.trainer.max_steps > 0 and cfg.distill.lora.r > 0
    if trainer in ("default", "cpu"):
        callbacks = [instantiate(c) for c in cfg.callbacks.values() if c]
        instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    assert _compose("draft=pretrained", "draft.source.path=/x").draft.source.path == "/x"


def test_fresh_draft_copies_or_projects_the_target_embedding():
    target = RandomInitSource(config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2), device="cpu").load()
    same = FreshDraft(num_hidden_layers=1).build(target).model
    torch.testing.assert_close(same.get_input_embeddings().weight, target.model.get_input_embeddings().weight)
    narrow = FreshDraft(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    draft = narrow.build(target)
    assert draft.model.config.hidden_size == 32 and draft.model.config.num_hidden_layers == 1
    e, d = target.model.get_input_embeddings().weight, draft.model.get_input_embeddings().weight
    # D = E V_k, V_k the top 32 eigenvectors of EᵀE: the best rank-32 approximation of E keeps exactly the 32
    # largest eigenvalues' energy (a random 32 of the 64 directions would keep about half)
    top = torch.linalg.eigvalsh(e.double().T @ e.double()).topk(32).values.sum()
    assert float((d.double() ** 2).sum()) == pytest.approx(float(top), rel=1e-4)
    cost = describe_cost(target, draft, context=16, repeats=2)
    assert 0 < cost["flops_ratio"] < 0.5 and cost["draft_ms"] > 0


@pytest.mark.parametrize("sizes, message", [
    ({"num_hidden_layers": 0}, "draft.num_hidden_layers must be an integer >= 1, got 0"),
    ({"hidden_size": 0}, r"draft.hidden_size \(or null for the target's\) must be an integer >= 1, got 0"),
])
def test_fresh_draft_refuses_empty_sizes(sizes, message):
    """hidden_size=0 used to read as null and build a full-width draft without a word."""
    with pytest.raises(SpecPolicyError, match=message):
        FreshDraft(**sizes)


def test_a_saved_draft_is_measured_by_the_experiment_s_trainer_on_one_device():
    """draft_metrics measured with a Trainer of two of cfg.trainer's fields; built from all of them, a data-parallel
    or multi-node trainer must still run on this one device (a second node would be waited for)."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from specpolicy.distill.stage import measuring_trainer

    trainer = measuring_trainer(_compose("trainer=ddp", "+trainer.num_nodes=2", "trainer.precision=bf16-mixed"))
    assert (trainer.num_devices, trainer.num_nodes) == (1, 1) and isinstance(trainer.strategy, SingleDeviceStrategy)
    assert trainer.precision == "bf16-mixed" and trainer.logger is None and not trainer.checkpoint_callbacks
