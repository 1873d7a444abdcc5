"""The entry points, run as a user runs them: bad input is one line naming the fix, exit code != 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from compose import ROOT, compose_config
from specpolicy import errors
from specpolicy.cli import bad_input, checkpoints_of, entry, experiment_logger, per_job, run_trainer
from specpolicy.cost.profile import profile_file
from specpolicy.pipeline import train


def run(script: str, *overrides: str, tmp_path: Path, env: dict[str, str | None] | None = None
        ) -> subprocess.CompletedProcess:
    """`scripts/<script> overrides...` writing under `tmp_path`; `env` sets (or, with None, removes) variables."""
    # HYDRA_FULL_ERROR asks for library errors' tracebacks
    changes = {"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HYDRA_FULL_ERROR": None, **(env or {})}
    env = {name: value for name, value in {**os.environ, **changes}.items() if value is not None}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), f"paths.checkpoints_dir={tmp_path}", *overrides],
        capture_output=True, text=True, env=env, timeout=300,
    )


def assert_clean_error(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["target=pretrained", "target.path=./nowhere/model"], "model path './nowhere/model' does not exist"),
        (["target=pretrained", "target.path=/tmp/absent.gguf"], "GGUF file '/tmp/absent.gguf' does not exist"),
        (["target=nope"], "Could not find 'target/nope'"),
        (["runtime.dtype=float33"], "unknown dtype 'float33'"),
        (["data.prompts_file=/tmp/no_prompts_here.jsonl"], "does not exist; fix data.prompts_file"),
        (["draft=layers", "draft.layers=[0,9]"], "indexes outside the target's 6 layers"),
        # an object Hydra builds refuses its setting: our message with the config key, not Hydra's wrapper
        (["eval.policies.static_k1.k=-1"],
         "error: eval.policies.static_k1: static depth must be an integer >= 0, got -1"),
        (["eval.hf_baselines=true", "eval.hf_assisted_k=0"], "eval.hf_assisted_k must be an integer >= 1, got 0"),
        (["data.limit=0"], "error: data.limit (or null for every prompt) must be an integer >= 1"),  # no "data: data."
        ([], "error: eval.policies.goodput: no latency profile at"),  # models load, the profile stage never ran
        # seed and engine settings fail before any model loads (strings were Hydra tracebacks; the engine's
        # other checks: test_engine_parity.py)
        (["seed=abc"], "error: seed must be an integer, got 'abc'"),
        (["engine.temperature=abc"], "error: engine.temperature must be a number >= 0, got 'abc'"),
    ],
)
def test_bad_input_is_one_line(overrides: list[str], message: str, tmp_path: Path) -> None:
    proc = run("evaluate.py", "experiment=tiny", "debug=fast", "draft=layers", *overrides, tmp_path=tmp_path)
    assert_clean_error(proc, message)


@pytest.mark.parametrize("multirun", [False, True])
def test_an_experiment_file_without_its_name_is_one_line(multirun: bool, tmp_path: Path) -> None:
    """The run's folder is named by experiment_name: reading it unset was a 52-frame omegaconf traceback (a single
    run, from Hydra's callback) or a job's traceback (a multirun, from the check of unset settings itself)."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text("# @package _global_\ndefaults:\n"
                                                                "  - override /target: tiny_llama\n")
    sweep = ["seed=1,2", "-m"] if multirun else []
    proc = run("train.py", "experiment=mine", "debug=fast", *sweep, "--config-dir", str(tmp_path / "conf"),
               tmp_path=tmp_path)
    assert_clean_error(proc, "error: experiment_name must be set (??? in conf/); add experiment_name=... to the "
                             "command, or set it in the experiment's file")


def test_prompt_longer_than_context_and_empty_file(tmp_path: Path) -> None:
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 200}) + "\n")
    proc = run("evaluate.py", "experiment=tiny", "debug=fast", "draft=layers", f"data.prompts_file={long}",
               "target.config.max_position_embeddings=128", tmp_path=tmp_path)
    assert_clean_error(proc, "exceeds the model's context of 128")
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    proc = run("evaluate.py", "debug=fast", "draft=layers", f"data.prompts_file={empty}", tmp_path=tmp_path)
    assert_clean_error(proc, "is empty")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["distill.temperature=0"], "distill.temperature must be a number > 0 (it divides the logits), got 0"),
        (["distill/loss=jsd", "distill.loss.beta=2"], "distill.loss.beta (jsd) must be in (0, 1), got 2"),
        (["distill.feature_loss=-1"], "distill.feature_loss must be a number >= 0 (a loss weight), got -1"),
        (["distill.optimizer.lr=-1"], "distill.optimizer: Invalid learning rate: -1"),
        (["head.lr=abc"], "head.lr must be a number > 0, got 'abc'"),
        (["trainer.max_steps=abc"], "trainer.max_steps must be an integer >= 1, got 'abc'"),
        # Lightning accepts these when built, then fails inside fit; the scheduler is built inside fit too
        (["head.trainer.max_epochs=abc"], "head.trainer.max_epochs must be an integer >= -1, got 'abc'"),
        (["distill.scheduler.num_warmup_steps=abc"], "distill.scheduler.num_warmup_steps must be an integer >= 0"),
        # a library class refusing its config when Hydra builds it: its own message, after the key
        (["trainer.val_check_interval=abc"], "error: trainer: lightning.pytorch.trainer.trainer.Trainer refused "
                                             "its settings: MisconfigurationException: Invalid time format"),
        (["collect.min_prompts_per_size=0"], "collect.min_prompts_per_size must be an integer >= 1, got 0"),
        # a required path left ??? was an omegaconf traceback once the distil stage had loaded the target
        (["draft=pretrained"], "error: draft.source.path must be set (??? in conf/); add draft.source.path=..."),
        # each ended in a library traceback, or (feature_loss, LoRA's frozen head) trained what was not asked for
        (["distill/loss=jsd", "distill.loss.beta=abc"], "distill.loss: '<' not supported"),
        (["+distill.loss.beta=0.5"], "distill.loss: forward_kl() got an unexpected keyword argument 'beta'"),
        (["+trainer.limit_val_batches=1"], "trainer.limit_val_batches=1: distil's metrics.json reports every"),
        (["trainer.max_steps=2"], "trainer.val_check_interval=3 is more batches than trainer.max_steps=2"),
        (["distill.feature_loss=3"], "distill.feature_loss=3 trains a draft that reads the target's features"),
        (["distill=lora", "distill.lora.r=0"], "distill.lora: `r` should be a positive integer"),
        (["distill=lora", "distill.lora.target_modules=[q_prj]"], "the draft's linear layers: ['down_proj', "),
        (["distill=lora", "distill.freeze_embeddings=false"], "LoRA trains adapters only, so the draft's embedding"),
        (["distill.data.top_k=100000"], "distill.data.top_k=100000 is more than the target's 260 tokens"),
        (["distill.data.max_new_tokens=5000"], "distill.data.max_new_tokens=5000 leaves no room for a prompt"),
        (["draft=fresh", "draft.hidden_size=36"], "heads of 9 dimensions, and rotary position embeddings need an even"),
    ],
)
def test_bad_distillation_setting_fails_before_training(overrides: list[str], message: str, tmp_path: Path,
                                                        capsys, monkeypatch) -> None:
    """These used to surface only in the Lightning loops: temperature 0 trained to the end on logits / 0 without
    a word, a negative feature weight trained too, beta=2 and a negative lr stopped in ValueError tracebacks
    (and min_prompts_per_size=0 in one from the collect stage's sampler). In-process through `entry`, what
    scripts/train.py runs (the scripts themselves: the subprocess tests around this one)."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # it asks for library errors' tracebacks
    cfg = compose_config("train", ["experiment=tiny", "debug=fast", *overrides], tmp_path)
    with pytest.raises(SystemExit) as stopped:
        entry(train, cfg)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "tiny" / "draft").exists()


def test_a_checkpoint_of_another_model_or_one_the_stages_do_not_keep_is_named(tmp_path: Path) -> None:
    """A head checkpoint of another size (or another stage's) ended in torch's load_state_dict traceback; `best`
    passed the checks and failed inside fit, after the stages before it had run."""
    import lightning as L
    import torch

    from specpolicy.cli import check_ckpt_path
    from specpolicy.policy.head import HeadConfig
    from specpolicy.policy.lightning import HeadModule, RolloutDataModule
    from specpolicy.rollout.features import FEATURE_NAMES

    data = RolloutDataModule(torch.rand(64, len(FEATURE_NAMES)), torch.randint(0, 2, (64,)).float(),
                             torch.arange(64) // 4)

    def fit(hidden: int, **kwargs) -> L.Trainer:
        trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path)
        run_trainer(trainer, "fit", HeadModule(HeadConfig(hidden=hidden)), datamodule=data, **kwargs)
        return trainer

    fit(16).save_checkpoint(tmp_path / "other.ckpt")
    with pytest.raises(errors.SpecPolicyError, match=f"^ckpt_path={tmp_path / 'other.ckpt'} is a checkpoint of "
                                                     f"another model, whose weights do not fit this stage's"):
        fit(8, ckpt_path=str(tmp_path / "other.ckpt"))
    with pytest.raises(errors.SpecPolicyError, match="^head.ckpt_path=best: the stages keep their last checkpoint"):
        check_ckpt_path("head.ckpt_path", "best")


def test_missing_trained_artifacts_say_which_stage_to_run(tmp_path: Path) -> None:
    proc = run("evaluate.py", "experiment=tiny", "debug=fast", tmp_path=tmp_path)
    assert_clean_error(proc, "draft' does not exist; run the distil stage of scripts/train.py for experiment_name=tiny "
                             "first, or point draft.source.path (for train.py's later stages and draft_metrics.py: "
                             "trained_draft.source.path) at a draft folder")


def test_train_then_evaluate_end_to_end(tmp_path: Path) -> None:
    """The whole pipeline on tiny models: distil -> profile -> collect -> head, then the report."""
    proc = run("train.py", "experiment=tiny", "debug=fast", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reuse distillation prompts" not in proc.stdout + proc.stderr  # data.limit=4 cut collect's prompts once
    exp = tmp_path / "tiny"
    profile = profile_file("profile", "cpu", "float32", skinny_gemm=True)
    for artefact in ("draft/config.json", "draft/metrics.json", profile, "rollouts/dataset_info.json", "head/head.pt"):
        assert (exp / artefact).exists(), artefact
    assert json.loads((exp / profile).read_text())["other_load_cores"] >= 0  # what others took while it timed
    again = run("train.py", "experiment=tiny", "debug=fast", tmp_path=tmp_path)
    assert again.returncode == 0 and (again.stdout + again.stderr).count("skipping") >= 4, again.stdout[-2000:]
    held_out = run("draft_metrics.py", "experiment=tiny", "debug=fast", tmp_path=tmp_path)
    assert held_out.returncode == 0, held_out.stderr[-3000:]
    distilled = json.loads((exp / "draft" / "metrics.json").read_text())["after"]
    measured = json.loads((exp / "draft_held_out.json").read_text())
    for got, want in ((measured, distilled), (measured["test"], distilled["test"])):  # the saved draft: as distilled
        assert got["agreement"] == pytest.approx(want["agreement"], abs=1e-6)
        assert got["expected_acceptance"] == pytest.approx(want["expected_acceptance"], abs=1e-5)
    decoded = measured["decoded"]  # static depth 4: the engine's counts per draft position
    assert len(decoded["conditional_at"]) == decoded["depth"] == 4 and decoded["reached_at"][0] > 0
    assert all((c is None) == (r == 0) for c, r in zip(decoded["conditional_at"], decoded["reached_at"]))  # not 0.0
    assert all(a <= r <= d for a, r, d in zip(decoded["accepted_at"], decoded["reached_at"], decoded["drafted_at"]))
    assert all(r <= a for r, a in zip(decoded["reached_at"][1:], decoded["accepted_at"]))  # i reached: i-1 kept
    no_depth = run("draft_metrics.py", "experiment=tiny", "debug=fast", "decode_depth=0", tmp_path=tmp_path)
    assert_clean_error(no_depth, "error: decode_depth must be an integer >= 1, got 0")
    proc = run("evaluate.py", "experiment=tiny", "debug=fast", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((exp / "report" / "report.json").read_text())
    assert {"device", "target", "draft", "runs"} <= set(report)
    required = {"policy", "batch_size", "tokens", "wall_s", "tokens_per_s", "speedup", "acceptance_rate",
                "mean_accepted", "mean_depth", "flops"}
    engine_runs = [r for r in report["runs"] if not r["policy"].startswith("hf_")]
    assert {r["policy"] for r in engine_runs} >= {"ar", "static_k4", "goodput", "learned", "oracle"}
    for r in engine_runs:
        assert required <= set(r) and {"useful", "rejected", "padding", "total", "ar_equivalent"} <= set(r["flops"])
    assert {r["policy"] for r in report["runs"]} >= {"hf_generate", "hf_assisted"}
    assert report["lossless"]["checked"] and report["lossless"]["exact"] and report["lossless"]["mismatches"] == []
    lines = (exp / "report" / "outputs.jsonl").read_text().splitlines()
    assert len(lines) == len(report["runs"]) * report["num_prompts"]  # transformers baselines' outputs too
    assert "report:" in proc.stdout


def test_the_readme_multirun_gives_each_job_its_own_experiment(tmp_path: Path) -> None:
    """README's offline sweep: `experiment_name=.../${hydra:job.num}` is read per job, so the sweep's own folder,
    made before any job, must not depend on it (it did, and the multirun stopped in a Hydra traceback)."""
    proc = run("train.py", "hydra.mode=MULTIRUN", "experiment=tiny", "debug=fast", "stages=[distil]",  # = -m
               "distill/loss=forward_kl,tvd", "experiment_name=sweep/${hydra:job.num}", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in ("0", "1"):
        assert (tmp_path / "sweep" / job / "draft" / "metrics.json").exists(), job
    assert len(list((tmp_path / "multirun" / "train").glob("*/multirun.yaml"))) == 1


def test_a_missing_pretrained_draft_names_the_key_of_the_script(tmp_path: Path) -> None:
    """draft_metrics reads `trained_draft`: the fix named target.path or draft.source.path, which it ignores."""
    proc = run("draft_metrics.py", "experiment=tiny", "debug=fast", "draft@trained_draft=pretrained",
               f"trained_draft.source.path={tmp_path / 'nothere'}", tmp_path=tmp_path)
    assert_clean_error(proc, "does not exist; point draft.source.path (for train.py's later stages and "
                             "draft_metrics.py: trained_draft.source.path)")


@pytest.mark.parametrize("script, mode", [("train.py", "RUN"), ("evaluate.py", "MULTIRUN")])
def test_a_checkpoints_dir_that_cannot_hold_folders_is_one_line(script: str, mode: str, tmp_path: Path) -> None:
    """Hydra makes the run's log folder under it before the task runs: it ended in a NotADirectoryError traceback
    under a file, and in a FileNotFoundError one where no folder can be made."""
    notes = tmp_path / "notes.txt"
    notes.write_text("")
    proc = run(script, f"hydra.mode={mode}", "experiment=tiny", "debug=fast", tmp_path=notes)
    assert_clean_error(proc, f"error: {notes} is a file, and this run writes its outputs into folders under it")
    if Path("/proc/self").is_dir():  # Linux: no one, root included, makes folders in /proc
        proc = run(script, f"hydra.mode={mode}", "experiment=tiny", "debug=fast", tmp_path=Path("/proc/specpolicy"))
        assert_clean_error(proc, "error: cannot make the run's folder /proc/specpolicy/")
    assert proc.returncode == 2


def test_each_job_of_an_evaluate_multirun_writes_its_own_report(tmp_path: Path) -> None:
    """The jobs of `-m 'eval.batch_sizes=[1],[2]'` shared eval.out_dir, and each wrote its report over the last."""
    proc = run("evaluate.py", "hydra.mode=MULTIRUN", "experiment=tiny", "debug=fast", "draft=layers",
               "eval.policies.goodput=null", "eval.policies.learned=null", "eval.hf_baselines=false",
               "eval.num_prompts=2", "eval.batch_sizes=[1],[2]", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "tiny" / "report").iterdir()  # named as the sweep's folder: a later sweep's job 0 is not
    assert sweep.name == next((tmp_path / "multirun" / "evaluate").iterdir()).name  # this one's (it overwrote it)
    for job, batch_size in (("0", 1), ("1", 2)):
        report = json.loads((sweep / job / "report.json").read_text())
        assert {r["batch_size"] for r in report["runs"]} == {batch_size}
        assert f"eval.batch_sizes=[{batch_size}]" in report["overrides"]  # which job it is, in the report itself


def test_a_multirun_job_with_bad_input_does_not_stop_the_sweep(tmp_path: Path) -> None:
    """Job 0's sys.exit(2) ended the whole multirun (SystemExit escapes Hydra's job handler): job 1 never ran."""
    proc = run("train.py", "hydra.mode=MULTIRUN", "experiment=tiny", "debug=fast", "stages=[distil]",
               "distill.temperature=2,1", "experiment_name=sweep/${hydra:job.num}", tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: 1 job(s) stopped on bad input:\n  job 0: distill.temperature=2 needs" in proc.stderr
    assert (tmp_path / "sweep" / "1" / "draft" / "metrics.json").exists()


@pytest.mark.parametrize("override, message", [("bench.ks=[0,1]", "bench.ks must be a non-empty list"),
                                               ("bench.repeats=0", "bench.repeats must be an integer >= 1"),
                                               ("bench.batch_sizes=[32]", "bench.batch_sizes [32] all exceed the 4"),
                                               # transformers' side is greedy: sampled ratios were not like for like
                                               ("engine.temperature=0.7", "bench_engine compares greedy decoding"),
                                               # a file on its path was found by the save, after the decoding
                                               ("bench.out=/dev/null/engine.json", "bench.out"),
                                               # a folder: the save replaced it, and every file in it was lost
                                               (f"bench.out={ROOT / 'conf'}", "is a folder holding other files")])
def test_engine_benchmark_names_a_bad_setting(override: str, message: str, tmp_path: Path) -> None:
    assert_clean_error(run("bench_engine.py", "experiment=tiny", "debug=fast", override, tmp_path=tmp_path), message)


@pytest.mark.parametrize("override, message", [
    ("profile.tokens=[]", "profile.tokens must be a non-empty list"),  # was a max() traceback
    ("runtime.dtype=bfloat16", "they apply to float32 on a CPU only"),  # both sides timed nn.Linear: noise as speed-ups
    ("profile.context=5000", "profile.context=5000 plus 3 new tokens (profile.tokens) exceeds the target's context"),
])
def test_skinny_benchmark_names_a_bad_setting(override: str, message: str, tmp_path: Path) -> None:
    """It times the profile stage's grid without the stage's checks."""
    proc = run("bench_skinny.py", "experiment=tiny", "debug=fast", override, tmp_path=tmp_path)
    assert_clean_error(proc, message)


@pytest.mark.parametrize("args, message", [(["bench.steps=0"], "bench.steps must be an integer >= 1, got 0"),
                                           (["distill.temperature=0"], "distill.temperature must be a number > 0"),
                                           (["bench.losses=[tvd,kl]"], "bench.losses: ['kl'] not among ['forward_kl'"),
                                           (["bench.shapes=[big]"], "bench.shapes: ['big'] not among ['layers'"),
                                           (["bench.shapes=fresh"], "bench.shapes must be a list, e.g. 'bench.shapes"),
                                           (["bench.losses=null"], "bench.losses must be a list"),  # a TypeError
                                           (["engine.max_new_token=5"],  # a typo: Hydra's composition traceback
                                            "Could not override 'engine.max_new_token'"),
                                           (["trainer.max_steps=4"],  # 4 steps in a run named for bench.steps
                                            "set trainer.max_steps with bench.steps"),
                                           (["distill/loss=jsd"],  # trained jsd in runs and rows named for another
                                            "set distill/loss with bench.losses")])
def test_distillation_benchmark_names_a_bad_setting(args: list[str], message: str, tmp_path: Path) -> None:
    """It calls the distil stage directly, outside the pipeline's script: its errors were tracebacks."""
    assert_clean_error(run("bench_distill.py", *args, tmp_path=tmp_path), message)


def test_distillation_benchmark_names_a_setting_alike_however_it_is_written(monkeypatch) -> None:
    """A run's folder and row carry a hash of the user's overrides: a multirun passes `lr=1e-3` on as `lr=0.001`,
    and the two made two rows for one setting."""
    import importlib.util

    from hydra.core.override_parser.overrides_parser import OverridesParser

    monkeypatch.setenv("PROJECT_ROOT", str(ROOT))  # the script sets it when unset
    spec = importlib.util.spec_from_file_location("bench_distill", ROOT / "scripts" / "bench_distill.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def key(overrides: list[str]) -> str:
        return script.settings_key(OverridesParser.create().parse_overrides(overrides))

    assert key(["distill.temperature=1e-1"]) == key(["distill.temperature=0.1"]) != key(["distill.temperature=2e-1"])
    assert key(["draft_layers=[0, 1]", "draft=layers"]) == key(["draft_layers=[0,1]", "draft=layers"])
    assert key(["+trainer.x=1"]) != key(["trainer.x=1"])


@pytest.mark.parametrize("sizes", ["[1,2]", "[2]"])  # [2] was a KeyError: no ar at 1
def test_engine_benchmark_reports_ratios_within_rounds(sizes: str, tmp_path: Path) -> None:
    """scripts/bench_engine.py on tiny models: every ratio comes with its geometric mean and its range over rounds,
    and equals the quotient of the two speeds printed beside it (a median of ratios did not); batch 1, where static
    k is compared, runs whether or not it is asked for."""
    proc = run("bench_engine.py", "experiment=tiny", "debug=fast", "draft=layers", "bench.num_prompts=2",
               f"bench.batch_sizes={sizes}", "bench.ks=[1]", "bench.repeats=2", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "tiny" / "bench" / "engine-float32.json").read_text())
    assert set(report["ratios"]) == {"engine_ar_vs_hf_generate@1", "engine_ar_vs_hf_generate@2",
                                     "engine_static_k1_vs_hf_assisted@1", "engine_static_k1_vs_engine_ar@1"}
    for key, ratio in report["ratios"].items():
        low, high = report["ratio_range"][key]
        assert 0 < low <= ratio <= high
        a, b = report["ratio_of"][key]
        assert ratio == pytest.approx(report["tokens_per_s"][a] / report["tokens_per_s"][b], rel=1e-9)
    assert report["assisted_settings"]["1"]["assistant_confidence_threshold"] == 0.0
    # every decoder wrote the engine's greedy ar output (fp32), and the file says on what it was measured
    assert report["same_as_engine_ar"] and set(report["same_as_engine_ar"].values()) == {1.0}
    assert {"hardware", "versions", "engine", "date"} <= set(report)
    assert set(report["other_load_cores"]) == {"1", "2"} and min(report["other_load_cores"].values()) >= 0


def test_wandb_online_without_a_key_fails_before_the_work(tmp_path: Path) -> None:
    """WANDB_MODE=online with no key ended evaluate in wandb's UsageError traceback after all the decoding; the
    logger now starts its run before the work, and that refusal is one line naming the fixes. (A subprocess:
    wandb keeps its mode in process-wide state that would leak into the offline tests.)"""
    online = {"WANDB_MODE": "online", "WANDB_API_KEY": None, "HOME": str(tmp_path),  # HOME: no ~/.netrc key
              "WANDB_CONFIG_DIR": str(tmp_path / "wandb")}
    proc = run("evaluate.py", "experiment=tiny", "debug=fast", "draft=layers", "logger=wandb",
               "eval.policies.goodput=null", "eval.policies.learned=null",  # no profile or head: models load first
               tmp_path=tmp_path, env=online)
    assert_clean_error(proc, "wandb could not start a run (UsageError: No API key configured")
    assert "or unset WANDB_MODE to log offline" in proc.stderr
    assert "evaluate: batch size" not in proc.stdout + proc.stderr  # nothing decoded first
    assert experiment_logger(compose_config("evaluate", ["experiment=tiny", "logger=none"], tmp_path)) is None


def test_each_stage_logs_to_a_wandb_run_of_its_own(tmp_path: Path, monkeypatch) -> None:
    """Lightning's WandbLogger joins the active run: the head stage's val/loss went into the distil run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_config("train", ["experiment=tiny", "logger=wandb"], tmp_path)
    distil, head = experiment_logger(cfg, "distil"), experiment_logger(cfg, "head")
    try:
        assert distil.experiment.id != head.experiment.id
        assert (distil.experiment.name, head.experiment.name) == ("tiny-train-distil", "tiny-train-head")
        assert head.experiment.group == "tiny"  # an experiment's runs together
        config = head.experiment.config  # runs of a sweep told apart by their settings (their config was empty)
        assert config["experiment_name"] == "tiny" and config["head"]["hidden"] == cfg.head.hidden
    finally:
        head.experiment.finish()
    bad = compose_config("train", ["experiment=tiny", "logger=wandb", "+logger.colour=red"], tmp_path)
    refusal = r"logger: wandb could not start a run \(TypeError: .*colour.*\); fix the logger.\* settings"
    with pytest.raises(errors.SpecPolicyError, match=refusal):  # was a TypeError traceback
        experiment_logger(bad, "distil")


def test_a_training_stage_ends_its_wandb_run(tmp_path: Path, monkeypatch) -> None:
    """The distil run stayed open through profile and collect: Ctrl-C there marked a finished distillation crashed."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    train(compose_config("train", ["experiment=tiny", "debug=fast", "logger=wandb", "stages=[distil]"], tmp_path))
    assert len(list(tmp_path.glob("**/offline-run-*"))) == 1 and wandb.run is None


def test_a_resumed_training_logs_on_into_its_wandb_run(tmp_path: Path, monkeypatch) -> None:
    """A killed distillation resumed from last.ckpt logged into a new wandb run of the same name."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_config("train", ["experiment=tiny", "logger=wandb"], tmp_path)
    folder = tmp_path / "checkpoints"
    first = experiment_logger(cfg, "distil", folder, "last").experiment.id
    (folder / "last.ckpt").write_bytes(b"")  # what the killed run left
    resumed = experiment_logger(cfg, "distil", folder, "last")
    try:
        assert resumed.experiment.id == first
        assert experiment_logger(cfg, "distil", folder, None).experiment.id != first  # ckpt_path=null starts over
    finally:
        sys.modules["wandb"].finish()


def test_the_checkpoints_folder_is_found_by_its_setting_not_its_key(tmp_path: Path) -> None:
    """Distil looked for `callbacks.model_checkpoint.dirpath` by name: under another key, a resumed run logged into
    a new wandb run and a truncated last.ckpt was found only after the models loaded. The head's truncated
    last.ckpt was not checked before distillation at all."""
    cfg = compose_config("train", ["experiment=tiny", "debug=fast", "callbacks.model_checkpoint=null",
                                   f"+callbacks.saver={{_target_: lightning.pytorch.callbacks.ModelCheckpoint, "
                                   f"dirpath: {tmp_path / 'mine'}}}"], tmp_path)
    assert checkpoints_of(cfg.callbacks) == str(tmp_path / "mine")
    assert checkpoints_of(cfg.head.trainer.callbacks) == str(tmp_path / "tiny" / "head" / "checkpoints")
    assert checkpoints_of(None) is None
    head_checkpoints = tmp_path / "tiny" / "head" / "checkpoints"
    head_checkpoints.mkdir(parents=True)
    (head_checkpoints / "last.ckpt").write_bytes(b"cut short")
    with pytest.raises(errors.SpecPolicyError, match=r"last.ckpt is not a whole checkpoint"):
        train(compose_config("train", ["experiment=tiny", "debug=fast", "head.ckpt_path=last"], tmp_path))
    assert not (tmp_path / "tiny" / "draft").exists()  # refused before the first stage


def test_an_output_folder_under_home_is_expanded(tmp_path: Path) -> None:
    """`eval.out_dir='~/reports'` wrote into a folder named `~` in the working directory; `paths.checkpoints_dir=
    ~/ckpts` put Hydra's logs there and stopped the distil stage in a rename between the two."""
    assert per_job("~/reports") == Path.home() / "reports"
    cfg = compose_config("train", ["experiment=tiny", 'paths.checkpoints_dir="~/ckpts"'], tmp_path)
    assert cfg.paths.experiment_dir == str(Path.home() / "ckpts" / "tiny")
    assert cfg.paths.cache_dir == str(Path.home() / "ckpts" / ".cache")


def test_a_wandb_mode_wandb_does_not_know_stops_before_the_first_stage(tmp_path: Path) -> None:
    """It stopped the first stage that logs in pydantic's traceback, after the stages before it had run."""
    proc = run("train.py", "experiment=tiny", "debug=fast", "logger=wandb", "stages=[profile,head]",
               tmp_path=tmp_path, env={"WANDB_MODE": "offlin"})
    assert_clean_error(proc, "WANDB_MODE='offlin' is not a wandb mode; set it to one of ['online', 'offline'")
    assert not (tmp_path / "tiny" / "profile").exists()


def test_ctrl_c_is_one_line_on_what_was_kept() -> None:
    """Ctrl-C ended every script in a KeyboardInterrupt traceback from wherever the loop was; a real SIGINT
    to a process inside `entry` now exits 130 with one line saying what survives and how to go on."""
    code = ("import os, signal, time; from specpolicy.cli import entry; "
            "entry(lambda cfg: (os.kill(os.getpid(), signal.SIGINT), time.sleep(30)), None)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert_clean_error(proc, "interrupted: outputs are saved whole or not at all")
    assert proc.returncode == 130 and "rerun the same command" in proc.stderr


def test_ctrl_c_inside_a_lightning_loop_comes_back_to_entry() -> None:
    """Lightning turns Ctrl-C into a graceful shutdown and sys.exit(1), past entry()'s line on what was kept;
    `cli.run_trainer` hands it back as the KeyboardInterrupt it was (other exits pass through), in fit and in
    validate (distil measures held-out prompts with validate and test, outside fit)."""
    import lightning as L
    import torch

    class Interrupted(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            raise KeyboardInterrupt

        def validation_step(self, batch, batch_idx):
            raise KeyboardInterrupt

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    handler = signal.getsignal(signal.SIGINT)
    data = [torch.zeros(1)]
    for how, loaders in (("fit", {"train_dataloaders": data}), ("validate", {"dataloaders": data})):
        trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        try:
            with pytest.raises(KeyboardInterrupt):
                run_trainer(trainer, how, Interrupted(), **loaders)
        finally:
            signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT while it shuts down
        assert trainer.interrupted, how


def test_a_lightning_loop_prints_no_warning_about_lightning_s_internals() -> None:
    """Lightning 2.6 under torch 2.13 warned that its own pytree code is deprecated after every validation: three
    lines of noise in each distil stage, none a user could act on."""
    import lightning as L
    import torch

    class Logs(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def validation_step(self, batch, batch_idx):
            self.log("val/x", self.w.sum() + batch.sum())

    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_trainer(trainer, "validate", Logs(), dataloaders=[torch.zeros(1)], verbose=False)
    assert not [str(w.message) for w in caught if "LeafSpec" in str(w.message)]


def test_the_entry_points_print_lightning_s_facts_but_not_its_advert(caplog: pytest.LogCaptureFixture) -> None:
    import lightning as L

    with caplog.at_level("INFO"):
        entry(lambda cfg: L.Trainer(logger=False, enable_progress_bar=False), None)
    assert "GPU available" in caplog.text and "Tip" not in caplog.text


def test_library_refusals_are_bad_input_and_our_own_errors_are_bugs(monkeypatch) -> None:
    """A misspelt `_target_`, a library class refusing its settings or a key our class does not take is one
    line; any other exception but SpecPolicyError from our own classes is a bug, whose traceback entry() shows."""
    with pytest.raises(InstantiationException) as misspelt:
        instantiate(OmegaConf.create({"opt": {"_target_": "torch.optim.Adamm"}}).opt)
    assert bad_input(misspelt.value).startswith("opt: cannot import torch.optim.Adamm (")
    with pytest.raises(InstantiationException) as refused:
        instantiate(OmegaConf.create({"opt": {"_target_": "torch.optim.SGD", "params": [], "lr": 0.1}}).opt)
    assert bad_input(refused.value) == "opt: torch.optim.sgd.SGD refused its settings: ValueError: " \
                                       "optimizer got an empty parameter list"
    with pytest.raises(InstantiationException) as unknown:
        instantiate(OmegaConf.create({"policy": {"_target_": "specpolicy.policy.StaticPolicy", "x": 1}}).policy)
    assert bad_input(unknown.value) == "policy: StaticPolicy.__init__() got an unexpected keyword argument 'x'; " \
                                       "see conf/ for the settings it takes"

    def bug(**_):
        raise TypeError("an internal mistake")

    bug.__module__, bug.__qualname__ = errors.__name__, "bug"  # as if it were one of ours
    monkeypatch.setattr(errors, "bug", bug, raising=False)
    with pytest.raises(InstantiationException) as ours:
        instantiate(OmegaConf.create({"stage": {"_target_": "specpolicy.errors.bug"}}).stage)
    assert bad_input(ours.value) is None
