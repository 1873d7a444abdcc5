"""Draft models built from, or checked against, the target.

Every draft source has `build(target) -> LoadedModel`, so `conf/draft/*.yaml` can swap how the draft
is made without the pipeline knowing: a subset of the target's layers (any indices, sharing its
embedding, final norm and head; optionally reading the target's features, `models.fusion`), a fresh small
model of the target's family (`FreshDraft`), or a pretrained model (hub id, HF folder, GGUF; e.g. a distilled
draft). `describe_cost` prints what a draft token costs relative to a target token, analytically and measured,
when a draft is built.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from specpolicy.cost.flops import FlopModel
from specpolicy.errors import SpecPolicyError, check_bool, check_count, check_int
from specpolicy.models.compat import check_compatible
from specpolicy.models.fusion import attach_fusion
from specpolicy.models.loading import LoadedModel, PretrainedSource
from specpolicy.models.skinny import SkinnyLinear, use_skinny_gemm
from specpolicy.models.vocab import load_vocab, use_subset_head

log = logging.getLogger(__name__)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The stack of transformer blocks, wherever the family keeps it (model.layers, transformer.h, ...)."""
    base = model.base_model
    for name in ("layers", "h", "blocks"):
        if isinstance(getattr(base, name, None), torch.nn.ModuleList):
            return getattr(base, name)
    n = model.config.num_hidden_layers  # deeper (OPT: model.decoder.layers): the first list of that many blocks
    attends = lambda block: any("attn" in name or "attention" in name for name, _ in block.named_children())  # noqa: E731
    for module in base.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n and all(map(attends, module)):
            return module
    raise SpecPolicyError(f"cannot find the decoder layers of a {model.config.model_type} model to build a draft")


# config lists of layer numbers, not one entry per layer (transformers' `layer_idx in config.<name>` checks)
LAYER_INDEX_LISTS = ("mlp_only_layers", "moe_layers", "index_layers", "rope_scaling_layers")


def check_loaded(target: LoadedModel) -> None:
    """Drafts are built from the target as its source loads it (model and tokenizer), where the engine takes bare
    models: passing `.model` here ended in "'LlamaModel' object has no attribute 'generation_config'"."""
    if not isinstance(target, LoadedModel):
        raise SpecPolicyError(f"a draft is built from the loaded target (e.g. PretrainedSource(...).load()), not "
                              f"from {type(target).__name__}")


@dataclass
class LayerSubsetDraft:
    """The target's embedding, final norm and head around a subset of its layers (e.g. [0, 1, -2, -1]);
    with `fuse_features`, an EAGLE-style draft that also reads the target's last hidden states (e.g. [-1])."""

    layers: list[int]
    fuse_features: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.layers, Sequence) or isinstance(self.layers, str):  # `draft_layers=3`
            raise SpecPolicyError(f"draft.layers must be a list of target layer indices, e.g. [{self.layers}], "
                                  f"got {self.layers!r}")
        self.layers = [check_int(f"draft.layers[{j}]", i) for j, i in enumerate(self.layers)]
        check_bool("draft_fuse_features", self.fuse_features)

    def build(self, target: LoadedModel) -> LoadedModel:
        check_loaded(target)
        source = decoder_layers(target.model)
        n = len(source)
        try:
            picked = [source[i] for i in self.layers]
        except IndexError:
            raise SpecPolicyError(f"draft.layers={list(self.layers)} indexes outside the target's {n} layers") from None
        if not picked:
            raise SpecPolicyError("draft.layers is empty; list at least one target layer index")
        config = _pick_layers(target.model.config, self.layers)
        draft = _empty_like(target.model, config)
        prefix = _layer_prefix(target.model, source)
        _check_kinds(picked, decoder_layers(draft), self.layers)
        state = {k: v for k, v in target.model.state_dict().items() if not k.startswith(prefix)}
        for new_idx, layer in enumerate(picked):
            state.update({f"{prefix}{new_idx}.{k}": v for k, v in layer.state_dict().items()})
        draft.load_state_dict(state, strict=True)
        if self.fuse_features:
            attach_fusion(draft)
        draft.eval().requires_grad_(False)
        indices = [i % n for i in self.layers]
        if len(indices) >= n:  # e.g. the default four layers of a four-layer target
            log.warning("draft.layers=%s takes as many layers as the target has (%d): the draft costs what the target "
                        "does, and speculating with it cannot pay; list fewer (e.g. draft_layers=[0,-1])",
                        list(self.layers), n)
        kind = "fused" if self.fuse_features else "layers"
        built = LoadedModel(draft, target.tokenizer, f"{target.name}-{kind}{'_'.join(map(str, indices))}")
        built.cost = describe_cost(target, built)
        return built


def _pick_layers(config: PretrainedConfig, layers: Sequence[int]) -> PretrainedConfig:
    """A copy of `config` for a model of the target's `layers`: every list with one entry per target layer
    (`layer_types`, SmolLM3's `no_rope_layers`, ...: those as long as the layer stack, token ids aside) keeps
    the entries of those layers, and lists of layer indices (`LAYER_INDEX_LISTS`) are renumbered, so each layer
    keeps the attention, RoPE and MLP kind its weights were trained in."""
    n = config.num_hidden_layers
    config = copy.deepcopy(config)
    config.num_hidden_layers = len(layers)
    for key, value in list(vars(config).items()):
        if not isinstance(value, (list, tuple)) or key.startswith("_") or "token_id" in key:
            continue
        if key in LAYER_INDEX_LISTS:
            setattr(config, key, [new for new, old in enumerate(layers) if old % n in value])
        elif len(value) == n:
            setattr(config, key, [value[i] for i in layers])
    return config


def _check_kinds(picked: Sequence[torch.nn.Module], slots: Sequence[torch.nn.Module], layers: Sequence[int]) -> None:
    """Each draft slot must be built as the target layer it receives (MoE or dense MLP, ...): kinds placed by a
    rule the draft's numbering breaks (e.g. Qwen2-MoE's `decoder_sparse_step`) are refused here, by name."""
    for j, (layer, slot) in enumerate(zip(picked, slots)):
        want = {k: v.shape for k, v in layer.state_dict().items()}
        if want != {k: v.shape for k, v in slot.state_dict().items()}:
            raise SpecPolicyError(
                f"draft.layers={list(layers)}: target layer {layers[j]} would sit at draft layer {j}, which the "
                f"target's config builds as another kind of layer ({type(slot).__name__} with other weights, "
                "e.g. a dense MLP where the target has experts: the config places kinds by layer number); pick "
                "layers whose kinds keep their places, or build a fresh draft (draft=fresh)")


def _empty_like(target: torch.nn.Module, config: PretrainedConfig) -> torch.nn.Module:
    """A randomly initialised model of `config` on the target's device and dtype, with its kind of linear layers,
    that stops where the target stops: `from_config` takes its EOS from `config.json`, which may lack the ids the
    target's generation config adds (a chat template's end of turn), and the draft writes on-policy data."""
    param = next(target.parameters())
    draft = AutoModelForCausalLM.from_config(config, dtype=param.dtype).to(param.device)
    draft.generation_config = copy.deepcopy(target.generation_config)
    skinny = any(isinstance(m, SkinnyLinear) for m in target.modules())
    return use_skinny_gemm(draft) if skinny else draft


def _layer_prefix(model: torch.nn.Module, layers: torch.nn.ModuleList) -> str:
    for name, module in model.named_modules():
        if module is layers:
            return name + "."
    raise AssertionError("decoder layers not found among the model's modules")


@dataclass
class PretrainedDraft:
    """A ready-made draft (e.g. a distilled one), checked against the target before use; a `draft_vocab.json`
    beside it (see `specpolicy.models.vocab`) narrows its LM head to the tokens listed there."""

    source: PretrainedSource

    def __post_init__(self) -> None:
        if not hasattr(self.source, "load"):  # a path: 'str' object has no attribute 'load'
            raise SpecPolicyError(f"PretrainedDraft takes a model source, e.g. PretrainedDraft(PretrainedSource("
                                  f"path={self.source!r})), got {type(self.source).__name__}")

    @property
    def vocab(self) -> torch.Tensor | None:
        """The tokens a distilled draft scores (its `draft_vocab.json`), or None: the whole vocabulary."""
        return load_vocab(self.source.path)

    def build(self, target: LoadedModel) -> LoadedModel:
        check_loaded(target)
        draft = self.source.load()
        check_compatible(target, draft)
        if (vocab := self.vocab) is not None:
            use_subset_head(draft, vocab)
        draft.cost = describe_cost(target, draft)
        return draft


@dataclass
class FreshDraft:
    """A new, smaller model of the target's family: fewer layers, optionally narrower.

    Unset sizes keep the target's. The layers are random (seeded); the embedding and head start from
    the target's, because they carry most of what a small draft can know: copied at the same width,
    and at a narrower width projected onto the top right-singular directions of the target's
    embedding, E V_k (the best rank-k approximation of E, so the tied head scores tokens as the
    target's would, up to rank k). A narrower draft is the only way below the cost of the target's
    own LM head (21% of SmolLM2-135M's per-token FLOPs).
    """

    num_hidden_layers: int = 2
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    init_from_target: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        check_count("draft.num_hidden_layers", self.num_hidden_layers)
        check_bool("draft.init_from_target", self.init_from_target)
        for size in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(self, size) is not None:  # null keeps the target's
                check_count(f"draft.{size} (or null for the target's)", getattr(self, size))

    def build(self, target: LoadedModel) -> LoadedModel:
        check_loaded(target)
        config = self._config(target.model.config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            draft = _empty_like(target.model, config)
        if self.init_from_target:
            self._init_from(target.model, draft)
        draft.eval().requires_grad_(False)
        name = f"{target.name}-fresh{config.num_hidden_layers}x{config.hidden_size}"
        built = LoadedModel(draft, target.tokenizer, name)
        built.cost = describe_cost(target, built)
        return built

    def _config(self, target_config: PretrainedConfig) -> PretrainedConfig:
        if self.num_hidden_layers > target_config.num_hidden_layers:
            raise SpecPolicyError(f"draft.num_hidden_layers={self.num_hidden_layers} is deeper than the target's "
                                  f"{target_config.num_hidden_layers}")
        config = _pick_layers(target_config, range(self.num_hidden_layers))  # the first layers' kinds
        hidden = self.hidden_size or config.hidden_size
        heads = self.num_attention_heads or config.num_attention_heads
        kv_heads = self.num_key_value_heads or min(getattr(config, "num_key_value_heads", heads) or heads, heads)
        if hidden % heads or heads % kv_heads:
            raise SpecPolicyError(f"draft.hidden_size={hidden} must divide into num_attention_heads={heads}, and "
                                  f"those into num_key_value_heads={kv_heads}; pick sizes that divide")
        narrowed = (hidden, heads) != (config.hidden_size, config.num_attention_heads)
        rotary = any(key.startswith("rope") for key in vars(config))  # rotates pairs of each head's dimensions
        if narrowed and rotary and hidden // heads % 2:  # was a shape error inside RoPE, when its cost was measured
            raise SpecPolicyError(f"draft.hidden_size={hidden} over {heads} heads gives heads of {hidden // heads} "
                                  f"dimensions, and rotary position embeddings need an even number; try "
                                  f"draft.hidden_size={hidden - heads} or {hidden + heads}")
        if self.hidden_size and self.hidden_size > target_config.hidden_size:
            raise SpecPolicyError(f"draft.hidden_size={hidden} is wider than the target's {target_config.hidden_size}")
        scale = hidden / config.hidden_size
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads = hidden, heads, kv_heads
        if getattr(config, "intermediate_size", None):  # GPT-2 and OPT size their MLPs by other names
            config.intermediate_size = self.intermediate_size or int(config.intermediate_size * scale)
        elif self.intermediate_size:
            raise SpecPolicyError(f"a {config.model_type} config has no intermediate_size; leave "
                                  "draft.intermediate_size null (the family's own MLP size applies)")
        # else the target's head_dim, which need not be hidden / heads (some configs derive it: no setter)
        if narrowed and "head_dim" in vars(config):
            config.head_dim = hidden // heads
        return config

    @torch.no_grad()
    def _init_from(self, target: torch.nn.Module, draft: torch.nn.Module) -> None:
        if draft.config.hidden_size == target.config.hidden_size:  # all but the layers is the target's: embedding,
            layers = _layer_prefix(target, decoder_layers(target))  # final norm, head, GPT-2's learned positions
            outside = {k: v for k, v in target.state_dict().items() if not k.startswith(layers)}
            draft.load_state_dict(outside, strict=False)
            return
        t_emb = target.get_input_embeddings().weight  # [V, H]
        d_emb = draft.get_input_embeddings().weight  # [V, h] (OPT: its word_embed_proj_dim, maybe H)
        basis = _top_directions(t_emb, d_emb.shape[1])  # [H, h]
        d_emb.copy_(t_emb @ basis)
        t_head, d_head = target.get_output_embeddings(), draft.get_output_embeddings()
        if d_head is not None and d_head.weight is not d_emb:  # untied head: project it the same way
            d_head.weight.copy_(t_head.weight @ basis)


def _top_directions(weight: torch.Tensor, k: int) -> torch.Tensor:
    """The identity at full width, else the k leading eigenvectors of WᵀW (right-singular vectors of W)."""
    width = weight.shape[1]
    if k == width:
        return torch.eye(width, dtype=weight.dtype, device=weight.device)
    gram = weight.double().T @ weight.double()  # [H, H]: cheaper than an SVD of the [V, H] matrix
    _, vectors = torch.linalg.eigh(gram)  # ascending eigenvalues
    return vectors[:, -k:].flip(-1).to(weight.dtype)


def describe_cost(target: LoadedModel, draft: LoadedModel, context: int = 256, repeats: int = 10) -> dict[str, float]:
    """Per-token cost of the draft relative to the target: analytic FLOPs (`FlopModel`) and the measured
    latency of one decode forward (one new token over a `context`-token cache, batch 1, timed as the profile
    stage times its grid: the fastest of `repeats` interleaved rounds; a draft with a vocabulary subset scores
    only the subset, as it does when drafting). Logged and returned."""
    from specpolicy.cost.profile import time_grid  # cost.profile imports the engine's modules

    context = min(context, target.context_length - 1, draft.context_length - 1)
    t_flops = FlopModel.from_model(target.model).per_token(context)
    d_flops = FlopModel.from_model(draft.model).per_token(context)
    ms = time_grid({"target": target.model, "draft": draft.model}, [1], [1], context, repeats, progress=None)
    t_ms, d_ms = ms["target"][0][0], ms["draft"][0][0]
    cost = {"flops_ratio": d_flops / t_flops, "latency_ratio": d_ms / t_ms, "target_ms": t_ms, "draft_ms": d_ms,
            "target_gflops_per_token": t_flops / 1e9, "draft_gflops_per_token": d_flops / 1e9}
    log.info("draft %s per token vs target %s: %.3f x FLOPs (%.3f vs %.3f GFLOP), %.3f x latency (%.2f vs %.2f ms, "
             "decode at context %d)", draft.name, target.name, cost["flops_ratio"], d_flops / 1e9, t_flops / 1e9,
             cost["latency_ratio"], d_ms, t_ms, context)
    return cost
