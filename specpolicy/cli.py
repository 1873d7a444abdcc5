"""What every entry point shares: one-line errors instead of tracebacks (`entry`, Hydra callbacks for the output
folders and failed multirun jobs), the training stages' resumable Lightning runs and their checkpoints, the
offline-by-default wandb logger, and benchmark reports saved whole and printed."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specpolicy.atomic import atomic_path, check_made_with, record
from specpolicy.errors import SpecPolicyError

INTERRUPTED = ("interrupted: outputs are saved whole or not at all, so none was left half-written; rerun the same "
               "command to go on (train.py keeps finished stages, collect shards and training checkpoints; "
               "evaluate.py and the benchmarks start over)")

log = logging.getLogger("specpolicy")

# Lightning's ckpt_path names other than `last`: the stages keep no best checkpoint (no metric is monitored), and
# run under neither SLURM's requeueing nor a model registry, so each failed inside fit, after the stages before it
UNKEPT_CKPT_NAMES = ("best", "hpc", "registry")
RUN_ID = "wandb_run_id.txt"  # beside a training stage's checkpoints: the wandb run a resumed training logs into
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")
FAILED_JOBS: list[str] = []  # a multirun's jobs that stopped on bad input (`FailedJobs`)


def _no_advert(record: logging.LogRecord) -> bool:
    """Lightning 2.6 advertises its cloud logger each time a Trainer is built (four times in a demo)."""
    return not record.getMessage().startswith("💡 Tip")


def entry(task: Callable[[Any], Any], cfg: DictConfig | Any) -> Any:
    """Run a pipeline task on its config (a Hydra config, or a script's parsed arguments); bad input exits with
    code 2 and one line naming the problem and the fix, Ctrl-C with 130 and one line on what was kept. In a
    multirun, a job's bad input ends that job only: the sweep goes on, and exits with 2 at its end."""
    if "WANDB_SWEEP_ID" not in os.environ:  # a `wandb agent`'s run reports to its sweep, online
        os.environ.setdefault("WANDB_MODE", "offline")  # no hub here; a user who sets WANDB_MODE goes online
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_no_advert)  # once: the same filter
    try:
        check_set(cfg)
        check_logger(cfg)
        return task(cfg)
    except (SpecPolicyError, InstantiationException) as err:
        problem = bad_input(err)
        if problem is None:
            raise
        print(f"error: {problem}", file=sys.stderr)
        if (job := _job_number()) is not None:
            FAILED_JOBS.append(f"job {job}: {problem}")
            return None
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C is a user's choice, not a failure to show a traceback for
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)


class OutputFolder(Callback):
    """Hydra callback (conf/hydra/default.yaml): a run whose log folder lies under a file
    (`paths.checkpoints_dir=notes.txt`) or where it cannot be made (`/proc/x`) ended in a traceback from Hydra's
    mkdir, before any check of ours could run; now one line, from making the folder just before Hydra does."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_folder(_run_folder(config, "hydra.run.dir"))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_folder(_run_folder(config, "hydra.sweep.dir"))


def _run_folder(config: DictConfig, key: str) -> str:
    """The run's folder, or one line on what it needs: it is named by experiment_name, which an experiment file of
    a user's own may leave unset (`???`), and reading it ended in a 52-frame omegaconf traceback."""
    try:
        return OmegaConf.select(config, key, throw_on_missing=True)
    except OmegaConfBaseException as err:
        try:
            check_set(config)
            why = f"the run's folder ({key}) cannot be read: {str(err).splitlines()[0]}"
        except SpecPolicyError as unset:
            why = str(unset)
        print(f"error: {why}", file=sys.stderr)
        sys.exit(2)


def _unset(tree: Any, prefix: str = "") -> list[str]:
    """The dotted keys of a config's container whose value is `???`."""
    if isinstance(tree, dict):
        return [k for key, value in tree.items() for k in _unset(value, f"{prefix}{key}.")]
    return [prefix[:-1]] if tree == "???" else []


def _check_folder(folder: str) -> None:
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        existing = _first_existing(Path(folder))
        why = (f"{existing} is a file, and this run writes its outputs into folders under it ({folder})"
               if not existing.is_dir() else f"cannot make the run's folder {folder}: {err.strerror}")
        print(f"error: {why}; point paths.checkpoints_dir at a folder you can write in", file=sys.stderr)
        sys.exit(2)


class FailedJobs(Callback):
    """Hydra callback (conf/hydra/default.yaml): a multirun whose jobs stopped on bad input lists them and exits
    with 2 once every job has run (a job's sys.exit(2) used to end the whole sweep at the first such job)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if FAILED_JOBS:
            print(f"error: {len(FAILED_JOBS)} job(s) stopped on bad input:", *FAILED_JOBS, sep="\n  ", file=sys.stderr)
            sys.exit(2)


def run_trainer(trainer: Trainer, how: str, module: LightningModule, **kwargs: Any) -> Any:
    """`trainer.fit` / `.validate` / `.test` (`how`), whose Ctrl-C comes back as a KeyboardInterrupt: Lightning
    shuts down gracefully, then calls sys.exit(1), which would skip entry()'s line on what was kept and how to
    go on (and exit with 1, not 130). A first run has no last.ckpt to resume: Lightning's hint to set save_last
    (set) would mislead. Lightning 2.6 asks torch >= 2.10 a deprecated question at every validation, which
    printed a FutureWarning about its own internals after each progress bar."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*there is no last checkpoint available")
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            return getattr(trainer, how)(module, **kwargs)
    except SystemExit:
        if trainer.interrupted:
            raise KeyboardInterrupt from None
        raise
    except RuntimeError as err:  # a checkpoint of another stage, or of another shape of model: torch's traceback
        path = kwargs.get("ckpt_path")
        if path not in (None, "last") and str(err).startswith("Error(s) in loading state_dict"):
            detail = str(err).splitlines()[1].strip() if "\n" in str(err) else str(err)
            raise SpecPolicyError(f"ckpt_path={path} is a checkpoint of another model, whose weights do not fit this "
                                  f"stage's ({detail:.160}); point ckpt_path at this stage's checkpoints, or null to "
                                  f"start over") from err
        raise


def resumable(stage: str, trainer: Trainer, ckpt_path: str | None, made_with: dict[str, Any]) -> None:
    """Resume (`ckpt_path=last`) only a whole checkpoint of a run of `stage` with these settings: a finished run's
    last.ckpt, left behind when its output was deleted to train again with other settings, resumed at its last
    step and saved the old weights under the new ones (or, for another head size, failed inside Lightning). Then
    record this run's settings beside its checkpoints (`atomic.record`). A run that does not resume from the
    folder first deletes the last.ckpt an earlier run left there: killed before its own first save, it left that
    under its record, and the next run resumed the old training as if it were the new one."""
    folder = trainer.checkpoint_callback.dirpath if trainer.checkpoint_callback else None
    check_ckpt_path(f"{stage} ckpt_path", ckpt_path, folder)
    if folder is None:
        return
    folder = Path(folder)
    resumes = ckpt_path == "last" and (folder / "last.ckpt").exists()
    if resumes:
        check_made_with(stage, folder, made_with, f"delete {folder} to start over with these settings, or restore "
                                                  f"those to resume it")
    if not trainer.is_global_zero:
        return
    starts_over = not resumes and ckpt_path in (None, "last")
    named = Path(ckpt_path) if ckpt_path not in (None, "last") else None  # a file to start from, kept
    if starts_over or named:
        # Lightning's "last" resumes last*.ckpt; the folder's other files are not this stage's to delete
        stale = [p for p in folder.glob("last*.ckpt") if named is None or not p.samefile(named)]
        if stale:
            log.info("%s: starting over, so the last checkpoint an earlier run left in %s is deleted", stage,
                     folder)
        for path in stale:
            path.unlink()
    record(folder, made_with)


def checkpoints_of(callbacks: Any) -> str | None:
    """The folder the configured checkpoint callback writes to, read from the callbacks' configs (a dict of them
    or a list): the logger, made before the trainer, looks there for the run to resume. Found by its `dirpath`,
    not by the key the callback has in the config, which a user may rename."""
    configs = callbacks.values() if isinstance(callbacks, dict | DictConfig) else callbacks or []
    return next((str(c.dirpath) for c in configs if c and c.get("dirpath")), None)


def check_ckpt_path(setting: str, ckpt_path: str | None, folder: str | Path | None = None) -> None:
    """A `ckpt_path` setting, checked before any work: a file it names, or `last` in the checkpoints `folder`."""
    if ckpt_path in UNKEPT_CKPT_NAMES:
        raise SpecPolicyError(f"{setting}={ckpt_path}: the stages keep their last checkpoint only; set {setting}=last "
                              f"to resume, a .ckpt file to start from, or null to start over")
    if ckpt_path == "last" and folder and (Path(folder) / "last.ckpt").exists():
        check_checkpoint("the checkpoint to resume from", Path(folder) / "last.ckpt")
    elif ckpt_path not in (None, "last"):
        check_checkpoint(setting, ckpt_path)


def check_checkpoint(setting: str, path: str | Path) -> None:
    """A Lightning checkpoint to resume from must be a whole one: a truncated file ended in torch's "failed finding
    central directory", a stray one in an unpickling error whose advice (weights_only=False) is unsafe."""
    path = Path(path)
    if not path.is_file():
        raise SpecPolicyError(f"{setting}: {path} does not exist; point it at a .ckpt file, or null to start over")
    if not zipfile.is_zipfile(path):  # torch saves checkpoints as zip archives, whose directory comes last
        raise SpecPolicyError(f"{setting}: {path} is not a whole checkpoint (cut short while saving, or another "
                              f"kind of file); delete it to start over")


def check_set(cfg: DictConfig | Any) -> None:
    """Settings left `???` in conf/ (a pretrained model's path) fail before any stage runs, not as an omegaconf
    traceback from wherever the first of them is read."""
    # from the unresolved settings: missing_keys resolves them, and a path made of an unset experiment_name fails so
    settings = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else {}
    missing = [key for key in _unset(settings) if not key.startswith("hydra.")]
    if missing:
        raise SpecPolicyError(f"{', '.join(missing)} must be set (??? in conf/); add "
                              f"{' '.join(key + '=...' for key in missing)} to the command, or set it in the "
                              f"experiment's file")


def bad_input(err: BaseException) -> str | None:
    """The SpecPolicyError behind `err`, prefixed with the config key when it came from an object Hydra built
    (`eval.policies.static_k1.k=-1` ends in an InstantiationException whose cause is ours); else a library's
    object refusing its settings; None otherwise (a bug: the traceback is shown)."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, SpecPolicyError):
        cause = cause.__cause__
    key = re.search(r"full_key: (\S+)", str(err)) if isinstance(err, InstantiationException) else None
    if cause is None:
        return library_refusal(err, key)
    if key is None or cause is err or str(cause).startswith(f"{key.group(1)}."):  # it names its setting already
        return str(cause)
    return f"{key.group(1)}: {cause}"


def library_refusal(err: BaseException, key: re.Match | None) -> str | None:
    """A library's class that Hydra could not import or build from its config (`trainer.devices=abc`, a
    misspelt `_target_`) or one of ours given a key it does not take, as one line naming the key; None for
    other errors of our own classes, whose every refusal is a SpecPolicyError (so those are bugs), and when
    HYDRA_FULL_ERROR=1 asks for the traceback."""
    target = re.search(r"target '([^']+)'", str(err))
    if key is None or target is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return None
    why = " ".join(str(err.__cause__ or "").split())
    if target.group(1).startswith("specpolicy."):  # a key the class does not take (`+...foo=1`), else a bug
        unknown = isinstance(err.__cause__, TypeError) and re.search(r"unexpected keyword|missing \d+ required", why)
        return f"{key.group(1)}: {why}; see conf/ for the settings it takes" if unknown else None
    if str(err).startswith("Error locating target"):
        return f"{key.group(1)}: cannot import {target.group(1)} ({why}); fix its _target_"
    return f"{key.group(1)}: {target.group(1)} refused its settings: {type(err.__cause__).__name__}: {why}"


def check_logger(cfg: DictConfig | Any) -> None:
    """A WANDB_MODE that wandb does not know stopped a run's first logging stage in pydantic's traceback, after
    the stages before it (profile, collect) had run."""
    mode = os.environ.get("WANDB_MODE")
    logs = isinstance(cfg, DictConfig) and cfg.get("logger") and cfg.logger.get("_target_")
    if logs and mode not in (None, *WANDB_MODES):
        raise SpecPolicyError(f"WANDB_MODE={mode!r} is not a wandb mode; set it to one of {list(WANDB_MODES)}, or "
                              f"unset it to log offline")


def experiment_logger(cfg: DictConfig, stage: str | None = None, checkpoints: str | Path | None = None,
                      ckpt_path: str | None = None) -> Logger | None:
    """The configured Lightning logger (None for `logger=none`), its run started here: wandb told to go online
    without a key fails now, in one line, not in a traceback after the work it was to log. Each call starts a
    run of its own, named after `stage` too: Lightning's WandbLogger joins the active run, so the head's
    `val/loss` went into the distil run's curve, and every job of a multirun into the first job's run. A
    training resumed from the last.ckpt in its `checkpoints` folder (`ckpt_path=last`) logs on into the wandb
    run it started (`RUN_ID`), where a killed run and its resumption were two runs of one name."""
    if not cfg.get("logger") or not cfg.logger.get("_target_"):
        return None
    finish_run()
    name, job = cfg.logger.get("name"), _job_number()
    suffix = [part for part in (stage, None if job is None else f"job{job}") if part]  # jobs' runs told apart
    extra: dict[str, Any] = {"name": "-".join([name, *suffix])} if suffix and name else {}
    run_file = Path(checkpoints) / RUN_ID if checkpoints else None
    resumes = ckpt_path == "last" and run_file is not None and (run_file.parent / "last.ckpt").exists()
    if resumes and run_file.is_file() and str(cfg.logger._target_).endswith("WandbLogger"):
        extra |= {"id": run_file.read_text().strip(), "resume": "allow"}
    logger = instantiate(cfg.logger, **extra)
    try:
        logger.experiment
    except Exception as err:
        if not (isinstance(err, TypeError) or type(err).__module__.startswith("wandb")):  # TypeError: a logger.* key
            raise
        why = " ".join(str(err).split())
        if "api key" in why.lower():
            fix = "run `wandb login` or set WANDB_API_KEY"
        elif type(err).__name__ == "CommError":
            fix = "check the network to wandb's server"
        else:
            fix = "fix the logger.* settings (conf/logger/)"
        raise SpecPolicyError(f"logger: wandb could not start a run ({type(err).__name__}: {why}); {fix}, or unset "
                              f"WANDB_MODE to log offline") from err
    # the run's config: without it, runs of a sweep (or the stages of one experiment) could not be told apart
    logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    run_id = getattr(logger.experiment, "id", None)  # not a string on a DDP rank other than 0
    if run_file is not None and isinstance(run_id, str):
        with atomic_path(run_file) as tmp:
            tmp.write_text(run_id)
    return logger


def finish_run(logger: Logger | None = None) -> None:
    """End the stage's logging run (`logger` finalised, the active wandb run finished) as the stage ends: left open,
    a distillation's run went on through profiling and collection, and a profile stopped with Ctrl-C marked it
    crashed."""
    if logger is not None:
        logger.finalize("success")
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def publish(report: dict, out: str | Path) -> None:
    """Save a benchmark's JSON report at `out` (all or nothing: a killed run leaves the previous one; a multirun
    job's in a folder of its own, `per_job`) and print it."""
    text = json.dumps(report, indent=2)
    with atomic_path(per_job(Path(out).parent) / Path(out).name) as tmp:
        tmp.write_text(text)
    print(text)


def per_job(folder: str | Path) -> Path:
    """`folder` (`~` expanded: it made a folder named `~` here), or in a Hydra multirun `<sweep>/<job number>` in it
    (the sweep's folder name, its start time): every job of an evaluate or benchmark sweep (`-m
    'eval.batch_sizes=[1],[8]'`) wrote its report over the one before, and then each sweep over the last's."""
    folder = Path(folder).expanduser()
    job = _job_number()
    if job is None:
        return folder
    return folder / Path(HydraConfig.get().sweep.dir).name / str(job)  # a later sweep's job 0 is another job 0


def _job_number() -> int | None:
    """This job's number in a Hydra multirun; None in a single run (or outside Hydra)."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return HydraConfig.get().job.num
    return None


def job_overrides() -> list[str] | None:
    """The command-line overrides of this Hydra job (None outside Hydra): which job of a sweep a report is."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def check_out_dir(setting: str, folder: str | Path) -> None:
    """A folder a run writes into at its end, checked before the work: a file on its path, or a folder this user
    cannot write in, was found by the report's mkdir after all the decoding, as a traceback. Writing is tried, not
    asked of `os.access`, which says yes to root in /proc."""
    if not isinstance(folder, (str, Path)):  # null: a TypeError inside pathlib
        raise SpecPolicyError(f"{setting} must be a folder's path, got {folder!r}")
    folder = Path(folder).expanduser()
    existing = _first_existing(folder)
    if not existing.is_dir():
        raise SpecPolicyError(f"{setting}={folder}: {existing} is a file; point {setting} at a folder")
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".write-probe-"))
    except OSError as err:
        raise SpecPolicyError(f"{setting}={folder}: cannot write in {existing} ({err.strerror}); point {setting} at a "
                              f"folder you can write in") from err


def _first_existing(folder: Path) -> Path:
    """`folder`, or the nearest of its parents that exists: where a mkdir of it would start, and fail on a file."""
    return next(p for p in [folder, *folder.parents] if p.exists())
