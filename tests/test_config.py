"""Every config in conf/ composes, and every option of every group instantiates."""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf

import synthetic
from compose import CONF, compose_config
from specpolicy.atomic import identity, record, settings
from specpolicy.distill.stage import draft_settings
from specpolicy.cli import bad_input
from specpolicy.cost.profile import profile_file
from specpolicy.data import TRAINED_ON, digests_text
from specpolicy.errors import SpecPolicyError, fitting_batch_sizes
from specpolicy.pipeline import check_held_out, eval_policies, evaluate, train

# options with mandatory values (???) get one here; the gpu trainer is only built where there is a GPU
REQUIRED = {("target", "pretrained"): ["target.path=org/model"], ("draft", "pretrained"): ["draft.source.path=org/m"]}
NEEDS_GPU = {("trainer", "gpu")}
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
OBJECT_GROUPS = ["target", "draft", "data", "engine", "logger", "trainer", "callbacks", "distill", "policy"]
ADDED = {"policy"}  # not in train's defaults (evaluate puts each under eval.policies): added to compose alone


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def fake_artifacts(experiment_dir: Path) -> None:
    """What the train stages leave for the load-aware policies: a latency profile (of the default kernel path,
    `runtime.skinny_gemm=true`) and a depth head."""
    synthetic.profile().save(profile_file(experiment_dir / "profile", "auto", "float32", skinny_gemm=True))
    synthetic.head_dir(experiment_dir / "head")


REUSES = {"smollm2_135m_batch_sweep": "smollm2_135m"}  # evaluates another experiment's trained artefacts


# every entry config
@pytest.mark.parametrize("name", ["train", "evaluate", "bench_engine", "draft_metrics", "bench_distill"])
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiments_compose_and_resolve(name: str, experiment: str, tmp_path: Path) -> None:
    cfg = compose_config(name, [f"experiment={experiment}"], tmp_path)
    OmegaConf.resolve(cfg)
    expected = REUSES.get(experiment, experiment)
    assert cfg.experiment_name == expected
    assert Path(cfg.paths.experiment_dir) == tmp_path / expected
    assert instantiate(cfg.draft) is not None  # train builds a draft, evaluate loads the distilled one: both take it


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in OBJECT_GROUPS for o in options(g)] + [("debug", "fast")]
)
def test_every_group_option_instantiates(group: str, option: str, tmp_path: Path) -> None:
    add = "+" if group in ADDED else ""
    overrides = [f"{add}{group}={option}", "experiment=tiny", *REQUIRED.get((group, option), [])]
    cfg = compose_config("train", overrides, tmp_path)
    fake_artifacts(tmp_path / "tiny")
    node = cfg.get(group)
    if group == "debug" or not node:  # debug edits other groups; logger=none / empty groups are "nothing"
        return
    gpu_only = (group, option) in NEEDS_GPU and not torch.cuda.is_available()
    objects = node.values() if group == "callbacks" else [node]  # callbacks: a dict of them, by name
    if gpu_only or not all("_target_" in obj for obj in objects):  # plain settings (distill), built in their stage
        OmegaConf.to_container(node, resolve=True)
        return
    for obj in objects:  # what `_target_` names: a class's instance, or a function waiting for its arguments
        built, target = instantiate(obj), get_object(obj._target_)
        if obj.get("_partial_"):
            assert isinstance(built, functools.partial) and built.func is target, built
        else:
            assert isinstance(built, target), built


@pytest.mark.parametrize("option", options("policy"))
def test_a_policy_built_from_python_decides_as_the_pipeline_s(option: str, tmp_path: Path) -> None:
    """conf/policy/ restates each setting so `--cfg job` shows it; a value tuned in one place and not the other
    (optimism was 0.5 in the YAML and 1.0 in the signature once) made `From Python` decode unlike the report."""
    node = compose_config("train", [f"+policy={option}", "experiment=tiny"], tmp_path).policy
    defaults = inspect.signature(get_object(node._target_)).parameters
    restated = {key: node[key] for key in node if not key.startswith("_") and not OmegaConf.is_interpolation(node, key)
                and not OmegaConf.is_config(node[key]) and defaults[key].default is not inspect.Parameter.empty}
    assert restated == {key: defaults[key].default for key in restated}
    assert option == "ar" or restated, "nothing compared: the option restates no default"


def test_evaluate_runs_every_policy_by_its_report_name(tmp_path: Path) -> None:
    cfg = compose_config("evaluate", ["experiment=tiny"], tmp_path)
    fake_artifacts(tmp_path / "tiny")
    policies = {name: instantiate(p) for name, p in cfg.eval.policies.items()}
    assert set(policies) == {"ar", "static_k1", "static_k2", "static_k3", "static_k4", "static_k6", "static_k8",
                             "disable_by_batch", "heuristic", "confidence", "entropy", "goodput", "learned", "oracle"}
    assert [policies[f"static_k{k}"].k for k in (1, 2, 3, 4, 6, 8)] == [1, 2, 3, 4, 6, 8]
    assert policies["ar"].max_depth == 0


def test_sampling_evaluates_every_policy_but_the_greedy_oracle(tmp_path: Path, caplog) -> None:
    """The default policy set includes the oracle, which exists for greedy decoding only: with a temperature
    the report holds every other policy instead of an error, and transformers' baselines, sampling too. The
    goodput policies say what they measured greedily: the depth head's rollouts, top-1 confidence, the profile."""
    cfg = compose_config("evaluate", ["experiment=tiny", "debug=fast", "draft=layers", "engine.temperature=0.8",
                                      "engine.top_p=0.9", "eval.batch_sizes=[1]", "eval.num_prompts=2"], tmp_path)
    fake_artifacts(tmp_path / "tiny")
    record(tmp_path / "tiny" / "head", {"engine": {"temperature": 0.0, "top_p": 1.0}})  # as `stages.head` keeps it
    evaluate(cfg)
    warned = {m.split(", but ")[0]: m for m in caplog.messages if m.startswith("evaluate: ") and ", but " in m}
    assert set(warned) == {f"evaluate: eval.policies.{name} decodes at temperature 0.8, top_p 0.9"
                           for name in ("goodput", "learned")}
    assert "rollouts decoded at greedy decoding" in warned[next(k for k in warned if "learned" in k)]
    assert "top-1 probability" in warned[next(k for k in warned if "goodput" in k)]
    assert all("latency profile timed greedy drafting" in message for message in warned.values())
    report = json.loads((tmp_path / "tiny" / "report" / "report.json").read_text())
    assert (report["temperature"], report["top_p"], report["seed"]) == (0.8, 0.9, cfg.engine.seed)
    assert "- **top p**: 0.9\n" in (tmp_path / "tiny" / "report" / "report.md").read_text()  # told from top_p=1
    assert {run["policy"] for run in report["runs"]} == set(cfg.eval.policies) - {"oracle"} | {"hf_generate",
                                                                                             "hf_assisted"}


@pytest.mark.parametrize("task, override, message", [
    ("evaluate", "eval.batch_sizes=[0]", "eval.batch_sizes must be"),
    ("evaluate", "eval.batch_sizes=[1,2.5]", "eval.batch_sizes must be"),
    ("evaluate", "eval.batch_sizes=[]", "eval.batch_sizes must be"),
    ("evaluate", "eval.batch_sizes=8", "eval.batch_sizes must be a list, e.g. eval.batch_sizes=[8]"),  # a TypeError
    ("evaluate", "eval.batch_sizes=[1,1]", "eval.batch_sizes must be a non-empty list of distinct"),  # decoded twice
    ("evaluate", "eval.num_prompts=0", "eval.num_prompts must be"),
    # null where no null means anything: TypeError and AttributeError tracebacks from torch, pathlib, the pipeline
    ("evaluate", "runtime.device=null", "unknown device None; use auto, cpu or cuda[:N]"),
    ("evaluate", "eval.out_dir=null", "eval.out_dir must be a folder's path, got None"),
    ("evaluate", "eval.policies=null", "eval.policies must map run names to policies (conf/evaluate.yaml), got None"),
    # 4 prompts (debug=fast): a batch of 8 ran 4 rows and was reported as batch 8 (with a size that fits: a warning)
    ("evaluate", "eval.batch_sizes=[8,16]", "eval.batch_sizes [8, 16] all exceed the 4 prompts to decode"),
    ("train", "profile.rows=[0,1]", "profile.rows must be"),
    ("train", "profile.tokens=[4,2]", "profile.tokens must be a non-empty list of distinct integers >= 1 in "
                                      "increasing order, got [4, 2]"),
    ("train", "profile.context=0", "profile.context must be"),
    ("train", "profile.repeats=-1", "profile.repeats must be"),
    ("train", "profile.overhead_steps=-4", "profile.overhead_steps must be"),
    ("train", "profile.overhead_steps=8", "profile.overhead_steps must be 0 (no drafting-overhead runs) or an "
                                          "integer >= 32"),  # was found after the timing grid had run
    ("train", "profile.tokens=[2,3]", "profile.tokens must start at 1 (plain decoding's pass)"),
    ("train", "profile.overhead_rounds=0", "profile.overhead_rounds must be"),
    ("train", "collect.batch_sizes=[1,0]", "collect.batch_sizes must be"),
    ("train", "collect.k=0", "collect.k must be"),
    ("train", "collect.max_new_tokens=1", "collect.max_new_tokens (2 or more: the last token is never drafted) must "
                                          "be an integer >= 2"),  # a torch.cat traceback after decoding
    # the cached top-k spreads the rest evenly, which tempering would turn into most of the mass
    ("train", "distill.temperature=2", "distill.temperature=2 needs the target's whole distribution"),
    # yes/no settings Hydra passes through as strings, which Python read as true: an EAGLE draft from "off"
    ("train", "draft_fuse_features=off", "draft_fuse_features must be true or false, got 'off'"),
    ("train", "distill.freeze_embeddings=no", "distill.freeze_embeddings must be true or false, got 'no'"),
    ("evaluate", "runtime.skinny_gemm=no", "runtime.skinny_gemm must be true or false, got 'no'"),
    ("evaluate", "eval.hf_baselines=abc", "eval.hf_baselines must be true or false, got 'abc'"),
    ("train", "head.trainer.max_epochs=0", "head.trainer.max_epochs=0 trains nothing"),  # saved a random head
    ("train", "head.trainer.devices=2", "the head trains on one device"),  # each rank saved its own head
    ("train", "distill.scheduler.num_warmup_steps=-5", "distill.scheduler.num_warmup_steps must be an integer >= 0"),
    ("train", "stages=distil", "stages must be a list, e.g. 'stages=[distil]'"),  # was "unknown stage(s) ['d', ...]"
    ("train", "head.ckpt_path=/nowhere/x.ckpt", "head.ckpt_path: /nowhere/x.ckpt does not exist"),  # was after distil
    ("train", "distill.data.top_k=0", "distill.data.top_k > 0 (the target's log-probs it keeps per position); set "
                                      "distill.data.top_k=64, or distill.target_probs=online"),  # was after loading
    ("train", "runtime.dtype=bf16x", "unknown dtype 'bf16x'"),  # stopped the profile stage, after distillation
    ("train", "data.split=tset", "data.split='tset' is not a split of"),  # stopped collect, after distillation
    # a range() ValueError inside sampling, after the target loaded; a bad top_p was named as engine.top_p
    ("train", ("distill/synthetic=magpie", "distill.synthetic.magpie.batch_size=0"),
     "distill.synthetic.magpie: batch_size must be an integer >= 1, got 0"),
    ("train", ("distill/synthetic=openings", "distill.synthetic.openings.top_p=0"),
     "distill.synthetic.openings: top_p must be a number in (0, 1], got 0"),
])
def test_a_bad_count_is_named_before_any_work(task: str, override: str | tuple[str, ...], message: str,
                                              tmp_path: Path) -> None:
    """evaluate before any model loads; train before the distil stage, for every selected stage's settings."""
    overrides = [override] if isinstance(override, str) else list(override)
    cfg = compose_config(task, ["experiment=tiny", "debug=fast", *overrides], tmp_path)
    with pytest.raises((SpecPolicyError, InstantiationException)) as err:  # Hydra wraps what objects refuse
        {"evaluate": evaluate, "train": train}[task](cfg)
    assert message in bad_input(err.value)  # the line the entry points print
    assert not (tmp_path / "tiny").exists()  # nothing distilled, nothing half-written


@pytest.mark.parametrize("setting, stage", [("paths.draft_dir", "distil"), ("paths.rollouts_dir", "collect")])
def test_an_output_path_naming_a_folder_of_files_is_refused_before_any_work(setting: str, stage: str,
                                                                          tmp_path: Path) -> None:
    """The stage's save replaced the folder whole: a parent folder named by mistake lost all it held."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    cfg = compose_config("train", ["experiment=tiny", "debug=fast", f"{setting}={mine}", f"stages=[{stage}]"],
                         tmp_path)
    with pytest.raises(SpecPolicyError, match=f"^{setting}={mine} is a folder holding other files"):
        train(cfg)
    assert (mine / "notes.txt").read_text() == "keep" and not (tmp_path / "tiny").exists()


def test_evaluate_refuses_a_report_folder_that_is_a_file_and_warns_about_what_it_cannot_show(tmp_path: Path,
                                                                                             caplog) -> None:
    """A file as eval.out_dir failed after all the decoding; evaluating the training split, or without `ar`, runs
    (a researcher may want it) but says what the numbers then mean."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for out_dir in (afile, afile / "report"):  # a file on the way was found by the report's mkdir, after decoding
        cfg = compose_config("evaluate", ["experiment=tiny", "debug=fast", f"eval.out_dir={out_dir}"], tmp_path)
        with pytest.raises(SpecPolicyError, match=f"eval.out_dir={out_dir}: {afile} is a file; point eval.out_dir at"):
            evaluate(cfg)
    if Path("/proc/self").is_dir():  # Linux: no one, root included, writes in /proc (os.access says root may)
        cfg = compose_config("evaluate", ["experiment=tiny", "debug=fast", "eval.out_dir=/proc/report"], tmp_path)
        with pytest.raises(SpecPolicyError, match="eval.out_dir=/proc/report: cannot write in /proc .*point eval"):
            evaluate(cfg)
    for override, warning in [("data.split=train", "data.split=train decodes prompts the draft was distilled on"),
                              ("eval.policies.ar=null", "eval.policies has no `ar`: no speedups"),
                              ("eval.only=[static_k1]", "eval.only names no `ar`: no speedups")]:
        cfg = compose_config("evaluate", ["experiment=tiny", "debug=fast", override, "eval.batch_sizes=[64]"], tmp_path)
        with caplog.at_level("WARNING", logger="specpolicy"), pytest.raises(SpecPolicyError):  # stop before decoding
            evaluate(cfg)
        assert warning in caplog.text


@pytest.mark.parametrize("keep, overrides, message", [
    (None, ["eval.policies.ar=null"], "eval.policies ['oracle'] need the target's greedy outputs, which `ar` decodes"),
    ((), ["eval.hf_baselines=false"], "nothing to decode: eval.policies is empty and eval.hf_baselines=false"),
    (("oracle",), ["engine.temperature=0.8", "eval.hf_baselines=false"],
     "nothing to decode: eval.policies is empty once the greedy-only ones are left out and eval.hf_baselines=false"),
    (None, ["eval.policies.oracle._target_=specpolicy.policy.Nope"], "eval.policies.oracle: cannot import "
                                                                    "'specpolicy.policy.Nope' (Error loading"),
    (None, ["eval.policies.oracle._target_=pathlib.Path"], "eval.policies.oracle is not a depth policy"),
    (None, ["eval.only=[ar,static_k9]"], "eval.only names ['static_k9'], not among eval.policies (ar, static_k1, "),
    (None, ["eval.only=[oracle]"], "which `ar` decodes: keep eval.policies.ar and name it in eval.only"),
])
def test_policies_that_cannot_make_a_report_are_refused_before_any_model_loads(keep, overrides, message, tmp_path,
                                                                                monkeypatch) -> None:
    """Each was found after the models loaded: "write_report got no runs", or the oracle's "needs the target's
    greedy outputs" after the other policies' warm-up."""
    monkeypatch.setattr("specpolicy.stages.load_pair", lambda *a: pytest.fail("a model loaded"))
    cfg = compose_config("evaluate", ["experiment=tiny", "debug=fast", *overrides], tmp_path)
    for name in list(cfg.eval.policies) if keep is not None else []:
        cfg.eval.policies[name] = cfg.eval.policies[name] if name in keep else None
    with pytest.raises(SpecPolicyError) as err:
        evaluate(cfg)
    assert message in bad_input(err.value) and "\n" not in bad_input(err.value)


@pytest.mark.parametrize("only, chosen", [("[learned,ar]", ["ar", "learned"]), ("static_k2", ["static_k2"]),
                                          ("null", None)])
def test_eval_only_picks_policies_in_the_rotation_s_order(only, chosen, tmp_path) -> None:
    cfg = compose_config("evaluate", ["experiment=tiny", "debug=fast", f"eval.only={only}"], tmp_path)
    assert list(eval_policies(cfg)) == (chosen or [name for name, p in cfg.eval.policies.items() if p is not None])


def test_evaluating_another_target_with_an_experiment_s_outputs_is_named(tmp_path, monkeypatch, caplog) -> None:
    """It ran without a word: a draft distilled for another target is a warning (it still decodes losslessly), the
    latency profile of another target that goodput and learned price their depths with stops evaluate."""
    monkeypatch.setattr("specpolicy.stages.load_pair", lambda *a: pytest.fail("a model loaded"))
    cfg = compose_config("evaluate", ["experiment=tiny", "debug=fast"], tmp_path)
    other = {"target": {**identity(cfg, "target"), "model_type": "qwen2"}}
    draft = Path(cfg.draft.source.path)
    draft.mkdir(parents=True)
    record(draft, other)
    profile = profile_file(Path(cfg.paths.experiment_dir) / "profile", cfg.runtime.device, cfg.runtime.dtype,
                           cfg.runtime.skinny_gemm)
    record(profile, other)
    with caplog.at_level("WARNING", logger="specpolicy"), pytest.raises(SpecPolicyError) as err:
        evaluate(cfg)
    assert f"the draft at {draft} was distilled for another target (target.model_type: qwen2 -> llama)" in caplog.text
    assert bad_input(err.value).startswith(f"eval.policies.goodput reads the latency profile {profile}, measured for "
                                           f"another target (target.model_type: qwen2 -> llama)")


def test_training_stages_name_a_draft_distilled_for_another_target(tmp_path, monkeypatch, caplog) -> None:
    """evaluate warned; profile and collect, which decode with the same draft, said nothing."""
    import specpolicy.pipeline

    cfg = compose_config("train", ["experiment=tiny", "debug=fast", "stages=[profile]"], tmp_path)
    draft = Path(cfg.trained_draft.source.path)
    draft.mkdir(parents=True)
    record(draft, {"target": {**identity(cfg, "target"), "model_type": "qwen2"}})
    monkeypatch.setitem(specpolicy.pipeline.STAGES, "profile", lambda cfg: None)
    with caplog.at_level("WARNING", logger="specpolicy"):
        train(cfg)
    assert f"train: the draft at {draft} was distilled for another target (target.model_type: qwen2 -> llama)" in (
        caplog.text)


def test_a_profile_or_head_made_with_another_draft_is_named(tmp_path, monkeypatch, caplog) -> None:
    """`evaluate.py draft=layers` priced drafting with the distilled draft's profile and took the distilled pair's
    acceptance from its head, without a word; the experiment's own draft gets no such warning."""
    monkeypatch.setattr("specpolicy.stages.load_pair", lambda *a: pytest.fail("a model loaded"))
    pair = settings(compose_config("train", ["experiment=tiny", "debug=fast"], tmp_path), ["target", "trained_draft"])
    cfg = compose_config("evaluate", ["experiment=tiny", "debug=fast"], tmp_path)
    profile = profile_file(Path(cfg.paths.experiment_dir) / "profile", cfg.runtime.device, cfg.runtime.dtype,
                           cfg.runtime.skinny_gemm)
    head = Path(cfg.eval.policies.learned.estimator.path)
    for out in (profile, head):
        out.parent.mkdir(parents=True, exist_ok=True)
        record(out, pair)
    for overrides, warned in (([], False), (["draft=layers"], True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="specpolicy"), pytest.raises(pytest.fail.Exception):
            evaluate(compose_config("evaluate", ["experiment=tiny", "debug=fast", *overrides], tmp_path))
        assert ("eval.policies.goodput reads the latency profile" in caplog.text) is warned, caplog.text
        assert ("which timed another draft (trained_draft._target_: specpolicy.models.draft.PretrainedDraft -> "
                "specpolicy.models.draft.LayerSubsetDraft" in caplog.text) is warned
        assert (f"the depth head of eval.policies.learned at {head} learned the acceptance of another draft"
                in caplog.text) is warned
        assert "of another target" not in caplog.text


def test_a_draft_is_reused_whatever_dtype_device_or_kernels_later_stages_run(tmp_path) -> None:
    """A bf16 rerun, or runtime.device=cpu for `auto`, refused a finished distillation that never used them."""
    base = draft_settings(compose_config("train", ["experiment=tiny", "debug=fast"], tmp_path))
    for override in ("runtime.dtype=bfloat16", "runtime.device=cpu", "runtime.skinny_gemm=false"):
        assert draft_settings(compose_config("train", ["experiment=tiny", "debug=fast", override], tmp_path)) == base


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": f"p{i}"} for i in range(40)], "every rollout prompt is also an evaluation prompt"),
    ([{"prompt": f"p{i}", "split": s} for i, s in enumerate(["train", "dev", "test"] * 10)],
     "distil reads the train/validation/test rows of {path}, whose `split` column has no validation (its splits: "
     "['dev', 'test', 'train']); name those rows' split validation"),
])
def test_a_prompts_file_the_pipeline_cannot_use_is_named_before_any_stage(rows, message, tmp_path) -> None:
    """Without a `split` column every prompt is an evaluation prompt, which collect refused after distil and
    profile had run; a `dev` split was "data.split='validation' is not a split", a setting never made."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose_config("train", ["experiment=tiny", "debug=fast", f"data.prompts_file={path}"], tmp_path)
    with pytest.raises(SpecPolicyError) as err:
        train(cfg)
    assert message.format(path=path) in bad_input(err.value)
    assert not (tmp_path / "tiny").exists()


def test_batch_sizes_beyond_the_prompts_are_left_out_by_name(caplog) -> None:
    """A batch of 8 over 4 prompts would run 4 rows under the name of batch 8: such sizes are dropped, loudly."""
    with caplog.at_level("WARNING", logger="specpolicy"):
        assert fitting_batch_sizes("eval.batch_sizes", [1, 4, 8, 16], 4, "raise eval.num_prompts") == [1, 4]
    assert "eval.batch_sizes [8, 16] exceed the 4 prompts to decode and are left out" in caplog.text
    assert fitting_batch_sizes("eval.batch_sizes", [1, 2], 4, "raise eval.num_prompts") == [1, 2]


def test_a_cpu_profile_belongs_to_its_instruction_set(tmp_path: Path, monkeypatch) -> None:
    """Two CPUs with the same model name but other vector units have other curves: other profile files."""
    names = {}
    for isa, bf16 in (("AVX2", False), ("AVX512", False), ("AVX512", True)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda isa=isa: isa)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda bf16=bf16: bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        names[isa, bf16] = profile_file(tmp_path, "cpu", "bfloat16").name
    assert names == {("AVX2", False): "cpu-avx2-bfloat16.json", ("AVX512", False): "cpu-avx512-bfloat16.json",
                     ("AVX512", True): "cpu-avx512-bf16-bfloat16.json"}


def test_a_profile_of_one_kernel_path_never_prices_the_other(tmp_path: Path) -> None:
    """Tall-GEMM and `nn.Linear` float32 CPU layers time differently: each has its own profile file, which
    the policies find from `runtime.skinny_gemm`; other dtypes run `nn.Linear` either way and share one."""
    assert profile_file(tmp_path, "cpu", "float32", True) != profile_file(tmp_path, "cpu", "float32", False)
    assert profile_file(tmp_path, "cpu", "bfloat16", True) == profile_file(tmp_path, "cpu", "bfloat16", False)
    fake_artifacts(tmp_path / "tiny")  # measured with skinny layers: the default
    skinny = profile_file("profile", "cpu", "float32", skinny_gemm=True).name
    record(tmp_path / "tiny" / "profile" / skinny, {})  # its settings record is not listed as a profile
    plain = compose_config("evaluate", ["experiment=tiny", "runtime.skinny_gemm=false"], tmp_path)
    refusal = (f"no latency profile .* holds \\['{skinny}'\\].*"
               "'stages=\\[profile\\]' runtime.dtype=float32 runtime.skinny_gemm=false")  # the settings to profile with
    with pytest.raises(Exception, match=refusal):  # hydra wraps it
        instantiate(plain.eval.policies.learned)


def test_debug_fast_uses_a_tiny_model_and_its_own_folder(tmp_path: Path) -> None:
    """`debug=fast` alone used to write a tiny draft into checkpoints/smollm2_135m, which the real pipeline
    then refused (made with other settings)."""
    cfg = compose_config("train", ["debug=fast"], tmp_path)
    assert cfg.target.model_type == "llama" and cfg.target._target_.endswith("RandomInitSource")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        debug, real = (compose("train", overrides=overrides) for overrides in (["debug=fast"], []))
    root = real.paths.root_dir
    assert (debug.paths.experiment_dir, real.paths.experiment_dir) == (f"{root}/checkpoints/debug/smollm2_135m",
                                                                       f"{root}/checkpoints/smollm2_135m")


def test_a_draft_is_not_evaluated_on_its_own_training_prompts(tmp_path: Path, caplog) -> None:
    """A prompts file without a `split` column is every split: distil held out its first rows only, and
    eval.num_prompts past them scored the draft on prompts it was distilled on. Known by content, so a copy of the
    file (another path, where a check by path looked) is refused as well."""
    texts = [f"Say {i}." for i in range(6)]
    copy = tmp_path / "copy.jsonl"
    copy.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    cfg = compose_config("evaluate", ["experiment=tiny", "debug=fast", f"data.prompts_file={copy}",
                                      "eval.num_prompts=4"], tmp_path)
    draft = Path(cfg.draft.source.path)
    draft.mkdir(parents=True)
    (draft / TRAINED_ON).write_text(digests_text([[{"role": "user", "content": t}] for t in texts[2:]]))
    with pytest.raises(SpecPolicyError, match=r"2 of the 4 prompts evaluate would decode .* the draft at .* trained on "
                                              r"\(the first: prompt 2\).*set eval.num_prompts=2.*a `split` column in "
                                              r"the file, test for the rows to evaluate"):
        evaluate(cfg)  # data.split=test would read the whole file again
    source = instantiate(cfg.data)
    policies = {"learned": cfg.eval.policies.learned}
    check_held_out(cfg, source, source.load()[:2], policies)  # the held-out rows alone
    head = Path(cfg.eval.policies.learned.estimator.path)  # a depth head whose rollouts decoded prompt 1
    head.mkdir(parents=True)
    (head / TRAINED_ON).write_text(digests_text([[{"role": "user", "content": texts[1]}]]))
    with pytest.raises(SpecPolicyError, match=r"1 of the 2 prompts .* the depth head of eval.policies.learned at .* "
                                              r"\(the first: prompt 1\).*set eval.num_prompts=1"):
        check_held_out(cfg, source, source.load()[:2], policies)
    # data.split=train asks for training prompts: how many were trained on is warned, only where some were (a hub
    # dataset's train split was warned about whatever it held, and never checked)
    split = tmp_path / "split.jsonl"
    split.write_text("\n".join(json.dumps({"prompt": t, "split": "train"}) for t in texts))
    asked = compose_config("evaluate", ["experiment=tiny", "debug=fast", f"data.prompts_file={split}",
                                        "data.split=train"], tmp_path)
    source = instantiate(asked.data)
    with caplog.at_level("WARNING", logger="specpolicy"):
        check_held_out(asked, source, source.load()[:2], policies)
        assert "1 of the 2 prompts (data.split=train) are prompts the depth head of eval.policies.learned" in (
            caplog.text)
        assert "the draft" not in caplog.text  # its list holds neither prompt
        caplog.clear()
        check_held_out(asked, source, source.load()[:1], policies)
        assert not caplog.text
