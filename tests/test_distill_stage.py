"""The distil stage end to end on tiny models, through the real Hydra config (debug=fast)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import AutoModelForCausalLM, AutoTokenizer

from specpolicy.data import PromptSource, trained_on
from specpolicy.distill.stage import _datamodule, _prompt_groups, distil
from specpolicy.distill.synthetic import PromptSynthesis
from specpolicy.errors import SpecPolicyError

CONF = Path(__file__).resolve().parents[1] / "conf"
PROMPTS = [f"Say {w} {i} times." for i, w in enumerate(["hi", "yes", "ok", "go", "a", "b", "c", "d"] * 2)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Short prompts (the byte tokenizer makes long ones long) and one data cache for every run here."""
    root = tmp_path_factory.mktemp("distill")
    rows = [{"prompt": p, "split": "train" if i < 12 else "validation"} for i, p in enumerate(PROMPTS)]
    rows += [{"prompt": f"Say {w} twice.", "split": "test"} for w in ("no", "up", "on", "in")]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return root


def _cfg(shared: Path, run: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=[
            "debug=fast", "experiment=tiny", "runtime.device=cpu", "trainer.accelerator=cpu",
            f"data.prompts_file={shared / 'prompts.jsonl'}", f"paths.checkpoints_dir={shared / run}",
            f"paths.cache_dir={shared / 'cache'}", "distill.data.max_new_tokens=8",
            *overrides])


def _metrics(shared: Path, run: str) -> dict:
    return json.loads((shared / run / "tiny" / "draft" / "metrics.json").read_text())


def test_debug_fast_distils_a_loadable_assistant(shared, recwarn):
    cfg = _cfg(shared, "e2e", "draft.layers=[0,-1]")
    distil(cfg)
    assert not [w for w in recwarn if "no last checkpoint" in str(w.message)]  # a first run has none to resume
    m = _metrics(shared, "e2e")
    assert m["steps"] == cfg.trainer.max_steps
    assert m["after"]["expected_acceptance"] > m["before"]["expected_acceptance"]
    assert m["cost"]["flops_ratio"] < 1 and {"agreement", "expected_acceptance"} <= set(m["after"])
    assert set(m["after"]["test"]) == {"loss", "agreement", "expected_acceptance"} == set(m["before"]["test"])
    draft = AutoModelForCausalLM.from_pretrained(shared / "e2e" / "tiny" / "draft")
    assert draft.config.num_hidden_layers == 2
    target = _target(cfg)
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=draft)
    assert torch.equal(plain, assisted)  # greedy assisted generation is lossless with our draft
    every = PromptSource(prompts_file=str(shared / "prompts.jsonl"), split="all").load()
    assert trained_on(shared / "e2e" / "tiny" / "draft", every) == list(range(12))  # the train rows, no held-out one
    before = (shared / "e2e" / "tiny" / "draft" / "metrics.json").stat().st_mtime_ns
    distil(cfg)  # second run: skipped
    assert (shared / "e2e" / "tiny" / "draft" / "metrics.json").stat().st_mtime_ns == before
    with pytest.raises(SpecPolicyError, match=r"^distil: .*draft was made with other settings \(distill.loss._target_: "
                                              r"specpolicy.distill.losses.forward_kl -> specpolicy.distill.losses.tvd"):
        distil(_cfg(shared, "e2e", "draft.layers=[0,-1]", "distill/loss=tvd"))  # was: skipped, old draft kept


def _data(cfg, target):
    return _datamodule(cfg, target, instantiate(cfg.draft).build(target), _prompt_groups(cfg, target))


def _target(cfg):
    from hydra.utils import instantiate

    return instantiate(cfg.target).load().model


def test_fresh_draft_lora_online_targets_on_draft_data(shared):
    distil(_cfg(shared, "lora", "draft=fresh", "draft.hidden_size=32", "draft.num_attention_heads=2",
                "draft.num_key_value_heads=1", "distill=lora", "distill/loss=jsd", "distill.target_probs=online",
                "distill.data.source=draft"))
    m = _metrics(shared, "lora")
    assert m["after"]["loss"] < m["before"]["loss"]
    draft = AutoModelForCausalLM.from_pretrained(shared / "lora" / "tiny" / "draft")
    assert draft.config.hidden_size == 32
    assert not any("lora" in k for k in draft.state_dict())  # merged before saving
    assert m["trainable_parameters"] > 0  # counted before merging removes the adapters


def test_lora_with_a_draft_vocabulary_saves_the_draft_it_measured(shared):
    """peft's all-linear spares the LM head but would adapt the Linear inside a subset head; the saved folder
    keeps the full head, so that adapter's training would be lost between metrics.json and the folder."""
    from specpolicy.distill.stage import held_out_metrics
    from specpolicy.stages import load_pair

    cfg = _cfg(shared, "lora_vocab", "draft.layers=[0,-1]", "distill=lora", "distill.draft_vocab=64")
    distil(cfg)
    m = _metrics(shared, "lora_vocab")
    target, draft = load_pair(cfg, cfg.trained_draft, "float32")  # as scripts/draft_metrics.py measures it
    again = held_out_metrics(cfg, target, draft)
    for key in ("loss", "agreement", "expected_acceptance"):
        assert again[key] == pytest.approx(m["after"][key], abs=1e-5), key


class RecordBatches(L.Callback):
    """The rows of every training batch, in order, and the epoch of each."""

    batches: list = []
    epochs: list = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        rows = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -1)
        RecordBatches.batches.append(sorted(tuple(t for t in r if t >= 0) for r in rows.tolist()))
        RecordBatches.epochs.append((trainer.current_epoch, trainer.max_epochs))


def test_gradient_accumulation_takes_fresh_batches_for_every_step(shared):
    """With accumulate_grad_batches=2 a step takes two batches: 3 steps of 2 x 4 rows go over the 12 training
    sequences twice, each pass a permutation (the sampler once ran out after max_steps batches). The whole run is
    Lightning's epoch 0 of 1 (its progress bar read "Epoch 0/-2" with max_epochs unset)."""
    RecordBatches.batches, RecordBatches.epochs = [], []
    distil(_cfg(shared, "accumulate", "draft.layers=[0,-1]", "trainer.max_steps=3", "trainer.val_check_interval=6",
                "+trainer.accumulate_grad_batches=2", "+callbacks.record._target_=test_distill_stage.RecordBatches"))
    assert _metrics(shared, "accumulate")["steps"] == 3
    batches = RecordBatches.batches
    assert len(batches) == 6 and RecordBatches.epochs == [(0, 1)] * 6
    for epoch in (batches[:3], batches[3:]):
        rows = [r for b in epoch for r in b]
        assert len(set(rows)) == len(rows) == 12


class CrashAt(L.Callback):
    """Stands in for a killed process: dies after optimizer step `step`, past the last checkpoint."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated kill")


def test_killed_run_resumed_from_last_matches_uninterrupted(shared, recwarn):
    """The resumed run trains steps 5-7 only, on the batches the uninterrupted run saw there: a run started
    over with the same seed would end at the same weights too, so that alone does not show a resume."""
    every = ["draft.layers=[0,-1]", "trainer.max_steps=7", "callbacks.model_checkpoint.every_n_train_steps=2",
             "trainer.val_check_interval=7", "+callbacks.record._target_=test_distill_stage.RecordBatches"]
    RecordBatches.batches = []
    distil(_cfg(shared, "straight", *every))
    straight_batches, RecordBatches.batches = RecordBatches.batches, []
    crash = [*every, "+callbacks.crash._target_=test_distill_stage.CrashAt", "+callbacks.crash.step=5"]
    with pytest.raises(BaseException, match="simulated kill"):
        distil(_cfg(shared, "resumed", *crash))
    ckpt_dir = shared / "resumed" / "tiny" / "distill" / "checkpoints"
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=False)["global_step"] == 4
    assert not (shared / "resumed" / "tiny" / "draft").exists()
    before_kill = torch.load(ckpt_dir / "last.ckpt", weights_only=False)["callbacks"]["Timer"]["time_elapsed"]["train"]
    # a last.ckpt of other settings is not resumed (it was, and its weights were saved under the new settings)
    with pytest.raises(SpecPolicyError, match=r"checkpoints was made with other settings \(distill.loss._target_: .*"
                                              r"\); delete .*checkpoints to start over"):
        distil(_cfg(shared, "resumed", *every, "distill/loss=tvd"))
    whole = (ckpt_dir / "last.ckpt").read_bytes()  # a kill while saving: torch's "failed finding central directory"
    (ckpt_dir / "last.ckpt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SpecPolicyError, match=r"last.ckpt is not a whole checkpoint .*; delete it to start over"):
        distil(_cfg(shared, "resumed", *every))
    (ckpt_dir / "last.ckpt").write_bytes(whole)
    RecordBatches.batches = []
    recwarn.clear()
    distil(_cfg(shared, "resumed", *every))  # distill.ckpt_path=last by default
    assert len(straight_batches) == 7 and RecordBatches.batches == straight_batches[4:]
    assert not [w for w in recwarn if "not resumable" in str(w.message)]  # Lightning's false alarm: it is
    straight, resumed = _metrics(shared, "straight"), _metrics(shared, "resumed")
    assert resumed["steps"] == straight["steps"] == 7
    assert resumed["train_seconds"] > before_kill > 0  # the time before the kill counts too
    for key in ("loss", "agreement", "expected_acceptance"):
        assert resumed["after"][key] == pytest.approx(straight["after"][key], abs=1e-6), key
    a = AutoModelForCausalLM.from_pretrained(shared / "straight" / "tiny" / "draft").state_dict()
    b = AutoModelForCausalLM.from_pretrained(shared / "resumed" / "tiny" / "draft").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)


def test_draft_vocab_narrows_the_head_and_saves_a_standard_folder(shared):
    cfg = _cfg(shared, "vocab", "draft.layers=[0,-1]", "distill.freeze_embeddings=true", "distill.draft_vocab=64")
    distil(cfg)
    m = _metrics(shared, "vocab")
    assert m["draft_vocab"] == 64 and m["draft"].endswith("-vocab64")
    assert m["after"]["loss"] < m["before"]["loss"]
    folder = shared / "vocab" / "tiny" / "draft"
    kept = json.loads((folder / "draft_vocab.json").read_text())["token_ids"]
    assert len(kept) == 64 and set(AutoTokenizer.from_pretrained(folder).all_special_ids) <= set(kept)  # EOS & co.
    draft = AutoModelForCausalLM.from_pretrained(folder)  # the full head, for assistant_model= and friends
    assert draft.get_output_embeddings().weight.shape[0] == draft.config.vocab_size
    from hydra.utils import instantiate

    target = instantiate(cfg.target).load()
    for weights in ("get_input_embeddings", "get_output_embeddings"):  # frozen in training, the full head restored
        assert torch.equal(getattr(draft, weights)().weight, getattr(target.model, weights)().weight), weights
    full = instantiate(cfg.draft).build(target)  # the same draft with its full head
    assert m["cost"]["flops_ratio"] < full.cost["flops_ratio"]


@pytest.mark.parametrize("prompt_loss", [False, True])
def test_a_draft_vocabulary_on_draft_written_data_is_ranked_by_what_the_target_writes(shared, prompt_loss):
    """With `source=draft` the training responses are the draft's; the vocabulary is ranked by the target's top-1
    on them (cached; with prompt_loss the cache starts in the prompt, which was ranked too), and without cached
    targets the setting is refused before anything loads."""
    from specpolicy.distill.stage import check_distil

    cfg = _cfg(shared, "vocab_draft", "draft.layers=[0,-1]", "distill.data.source=draft",
               f"distill.data.prompt_loss={prompt_loss}")
    target = instantiate(cfg.target).load()
    datamodule = _data(cfg, target)
    rows = datamodule._load()["train"]
    for ids, n, written in list(zip(rows["input_ids"], rows["prompt_len"], datamodule.train_responses()))[:3]:
        with torch.no_grad():
            logits = target.model(torch.tensor([ids])).logits[0]
        assert written == logits[n - 1: len(ids) - 1].argmax(-1).tolist()
    if prompt_loss:
        return
    online = _cfg(shared, "vocab_draft", "distill.data.source=draft", "distill.draft_vocab=64",
                  "distill.freeze_embeddings=true", "distill.target_probs=online")
    with pytest.raises(SpecPolicyError, match="distill.draft_vocab with distill.data.source=draft ranks tokens"):
        check_distil(online)


def test_a_saved_draft_with_a_vocabulary_distils_on_in_its_subset(shared, tmp_path):
    """A folder with draft_vocab.json loads with its subset head: it distils on in that subset (writing its own
    training responses as it drafts, with `source=draft`) and saves the full head with the same subset beside it.
    It was refused: the user had to copy the folder without the file, and the copy wrote with the full head."""
    from specpolicy.distill.stage import check_distil
    from specpolicy.models.loading import save_model
    from specpolicy.models.vocab import VOCAB_FILE, frequent_tokens, vocab_file_text

    target = instantiate(_cfg(shared, "again").target, dtype="float32").load()
    built = instantiate(_cfg(shared, "again", "draft.layers=[0,-1]").draft).build(target)
    size = target.model.config.vocab_size  # a subset that is not a prefix of the ids: its order and ids differ
    vocab = frequent_tokens([list(range(1, size, 3))], 64, size, target.tokenizer.all_special_ids)
    save_model(tmp_path / "d", built.model, built.tokenizer, {VOCAB_FILE: vocab_file_text(vocab)})
    saved = ("draft=pretrained", f"draft.source.path={tmp_path / 'd'}", "distill.data.source=draft")
    cfg = _cfg(shared, "again", *saved, "distill.freeze_embeddings=true", "trainer.max_steps=2",
               "trainer.val_check_interval=2")
    rows = _data(cfg, target)._load()["train"]
    assert all(set(ids[n:]) <= set(vocab.tolist()) for ids, n in zip(rows["input_ids"], rows["prompt_len"]))
    distil(cfg)
    m = _metrics(shared, "again")
    assert m["draft_vocab"] == 64 and m["draft"].endswith("-vocab64") and m["steps"] == 2
    folder = shared / "again" / "tiny" / "draft"
    assert json.loads((folder / VOCAB_FILE).read_text())["token_ids"] == vocab.tolist()
    draft = AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(draft.get_output_embeddings().weight, built.model.get_output_embeddings().weight)
    with pytest.raises(SpecPolicyError, match=r"scores 64 tokens .* set distill.draft_vocab=64 or null, or point "):
        check_distil(_cfg(shared, "again", *saved, "distill.freeze_embeddings=true", "distill.draft_vocab=32"))
    with pytest.raises(SpecPolicyError, match=r"a draft with draft_vocab.json \(.*\) needs distill.freeze_embed"):
        check_distil(_cfg(shared, "again", *saved))


def test_distillation_trains_fp32_weights_whatever_the_runtime_dtype(shared):
    """A pretrained draft loaded in runtime.dtype too: bf16 beside the fp32 target, refused as "different
    devices/dtypes" (so `smollm2_135m_long draft=pretrained` could not distil)."""
    distil(_cfg(shared, "bf16", "draft.layers=[0,-1]", "runtime.dtype=bfloat16", "trainer.max_steps=2",
                "trainer.val_check_interval=2"))
    config = json.loads((shared / "bf16" / "tiny" / "draft" / "config.json").read_text())
    assert config["dtype"] == "float32"
    distil(_cfg(shared, "bf16_again", "draft=pretrained", f"draft.source.path={shared / 'bf16' / 'tiny' / 'draft'}",
                "runtime.dtype=bfloat16", "trainer.max_steps=2", "trainer.val_check_interval=2"))
    assert _metrics(shared, "bf16_again")["steps"] == 2


def test_draft_vocab_with_trainable_embeddings_is_refused(shared):
    with pytest.raises(SpecPolicyError, match="distill.draft_vocab needs distill.freeze_embeddings=true"):
        distil(_cfg(shared, "vocab_bad", "distill.draft_vocab=64"))
    zero = r"distill.draft_vocab \(or null for the full head\) must be an integer >= 1, got 0"  # not read as null
    with pytest.raises(SpecPolicyError, match=zero):
        distil(_cfg(shared, "vocab_zero", "distill.draft_vocab=0", "distill.freeze_embeddings=true"))


def test_synthetic_prompts_join_the_training_set_as_their_own_cached_group(shared, monkeypatch):
    texts = ["Say x.", "Say y.", "Say z."]
    monkeypatch.setattr(PromptSynthesis, "sample", lambda *a: [*texts, PROMPTS[12]])  # [12]: a validation prompt
    cfg = _cfg(shared, "synthetic", "distill/synthetic=magpie")
    target = instantiate(cfg.target, dtype="float32").load()
    data = _data(cfg, target)
    data.setup("fit")
    groups = {name: datasets.load_from_disk(str(path)) for name, path in data._build().items()}
    assert set(groups) == {"train", "magpie", "validation", "test"}
    tok = target.tokenizer
    assert [tok.decode(ids[:n]) for ids, n in zip(groups["magpie"]["input_ids"], groups["magpie"]["prompt_len"])] \
        == [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts]
    assert len(data.sets["train"]) == len(groups["train"]) + len(texts)
    assert data.sets["validation"]["input_ids"] == groups["validation"]["input_ids"]  # held-out sets untouched
    test = groups["test"]
    assert [tok.decode(ids[:n]).count("twice") for ids, n in zip(test["input_ids"], test["prompt_len"])] \
        == [1] * 4  # the test split's prompts, and only those

    synthesis = "specpolicy.distill.synthetic.PromptSynthesis"
    clash = _cfg(shared, "synthetic", f"+distill.synthetic.validation._target_={synthesis}")
    with pytest.raises(SpecPolicyError, match="clashes with the 'validation' prompts"):
        _prompt_groups(clash, target)


def test_synthetic_openings_come_from_train_prompts_only(shared, tmp_path, monkeypatch):
    """A train row that is also a validation row is not trained on, and its first words open no synthetic prompt."""
    rows = [{"prompt": p, "split": "train" if i < 12 else "validation"} for i, p in enumerate(PROMPTS)]
    rows.append({"prompt": "Count to nine please.", "split": "train"})
    rows.append({"prompt": "Count to nine please.", "split": "validation"})
    (tmp_path / "overlap.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    seen = []

    def sample(self, model, tokenizer, openings=()) -> list[str]:
        seen.extend(openings)
        return ["Say q."]

    monkeypatch.setattr(PromptSynthesis, "sample", sample)
    cfg = _cfg(shared, "openings", f"data.prompts_file={tmp_path / 'overlap.jsonl'}", "distill/synthetic=openings",
               "distill.data.test_prompts=0")
    target = instantiate(cfg.target, dtype="float32").load()
    _prompt_groups(cfg, target)
    assert seen and not any(o.startswith("Count") for o in seen)


def test_a_prompt_set_without_a_test_split_says_how_to_go_without(shared, tmp_path):
    rows = [{"prompt": p, "split": "train" if i < 12 else "validation"} for i, p in enumerate(PROMPTS)]
    (tmp_path / "no_test.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = _cfg(shared, "no_test", f"data.prompts_file={tmp_path / 'no_test.jsonl'}")
    target = instantiate(cfg.target, dtype="float32").load()
    with pytest.raises(SpecPolicyError, match="split='test'.*distill.data.test_prompts=0"):
        _prompt_groups(cfg, target)
    cfg = _cfg(shared, "no_test", f"data.prompts_file={tmp_path / 'no_test.jsonl'}", "distill.data.test_prompts=0")
    assert "test" not in _data(cfg, target).held_out


def test_prompts_that_are_also_held_out_are_not_trained_on(shared, tmp_path):
    rows = [{"prompt": p, "split": "train" if i < 12 else "validation"} for i, p in enumerate(PROMPTS)]
    rows += [{"prompt": PROMPTS[i], "split": "train"} for i in (12, 13)]  # two validation prompts listed as train too
    (tmp_path / "overlap.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = _cfg(shared, "overlap", f"data.prompts_file={tmp_path / 'overlap.jsonl'}", "distill.data.test_prompts=0",
               "distill.data.train_prompts=null")
    target = instantiate(cfg.target, dtype="float32").load()
    data = _data(cfg, target)
    assert len(data.prompts["train"]) == 12  # all 14 train rows but the two held-out ones
    unsplit = tmp_path / "unsplit.jsonl"  # no `split` column: the whole file is every split
    unsplit.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    cfg = _cfg(shared, "overlap", f"data.prompts_file={unsplit}", "distill.data.train_prompts=8")  # = validation's 8
    with pytest.raises(SpecPolicyError, match="every train prompt is also a validation or test prompt"):
        _prompt_groups(cfg, target)
    # its test prompts were its first 4, all validation prompts, reported as "prompts nothing was tuned on"
    groups = _prompt_groups(_cfg(shared, "overlap", f"data.prompts_file={unsplit}", "distill.data.train_prompts=null"),
                            target)
    texts = {name: [c[0]["content"] for c in group] for name, group in groups.items()}
    assert texts["validation"] == PROMPTS[:8] and texts["test"] == PROMPTS[8:12]
    assert not set(texts["train"]) & set(PROMPTS[:12])


def test_a_fused_draft_trains_on_cached_target_features_and_reloads(shared):
    """draft=fused: the target's hidden states are cached beside the training data, the fusion layer
    learns to read them, and the saved folder reloads as the same fusing draft that decodes losslessly."""
    from specpolicy.decode import Engine
    from specpolicy.models.draft import PretrainedDraft
    from specpolicy.models.fusion import fuses_features
    from specpolicy.models.loading import PretrainedSource
    from specpolicy.policy import StaticPolicy

    cfg = _cfg(shared, "fused", "draft_layers=[-1]", "draft_fuse_features=true", "distill.feature_loss=1.0",
               "distill.unroll=1", "trainer.max_steps=4")
    distil(cfg)
    m = _metrics(shared, "fused")
    assert "-fused" in m["draft"] and m["after"]["loss"] < m["before"]["loss"]
    assert list((shared / "cache" / "distill").glob("train-*-features"))
    folder = shared / "fused" / "tiny" / "draft"
    target = instantiate(cfg.target).load()
    draft = PretrainedDraft(PretrainedSource(str(folder), device="cpu")).build(target)
    assert fuses_features(draft.model)
    trained = draft.model.feature_fusion.proj.weight
    hidden = trained.shape[0]
    assert trained[:, hidden:].abs().sum() > 0  # it reads the features now (they start ignored)
    prompts = [[5, 6, 7, 8], [9, 10]]
    engine = Engine(target.model, draft.model, max_new_tokens=6)
    plain = [target.model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
             for p in prompts]
    assert engine.generate(prompts, StaticPolicy(k=2)).outputs == plain
    with pytest.raises(SpecPolicyError, match="distill.data.source=target"):
        distil(_cfg(shared, "fused_draft_data", "draft_fuse_features=true", "distill.data.source=draft"))
    with pytest.raises(SpecPolicyError, match="distill.unroll=1 trains a draft that reads the target's features"):
        distil(_cfg(shared, "unrolled_plain", "distill.unroll=1"))


def test_a_draft_identical_to_the_target_agrees_everywhere(shared):
    """The held-out agreement is the issue's headline figure: a draft made of all the target's layers must
    agree on every response position (greedy argmax against the cached top-1, over exactly the masked
    positions), and its loss is near 0; a two-layer draft must not."""
    distil(_cfg(shared, "same", "draft.layers=[0,1,2,3,4,5]", "trainer.max_steps=1", "trainer.val_check_interval=1"))
    before = _metrics(shared, "same")["before"]
    assert before["agreement"] == 1.0 and before["test"]["agreement"] == 1.0
    assert before["loss"] == pytest.approx(0.0, abs=0.05)  # the cached top-k: a little mass outside it
    distil(_cfg(shared, "two", "draft.layers=[0,-1]", "trainer.max_steps=1", "trainer.val_check_interval=1"))
    assert _metrics(shared, "two")["before"]["agreement"] < 1.0
