"""Model sources (hub id, HF folder, GGUF file, tiny random) and target/draft compatibility checks."""

from specpolicy.models.compat import check_compatible
from specpolicy.models.loading import LoadedModel, PretrainedSource, RandomInitSource

__all__ = ["LoadedModel", "PretrainedSource", "RandomInitSource", "check_compatible"]
