"""Draft distillation: divergences (losses), cached distillation data (data), Lightning wrappers (module),
and the `distil` pipeline stage (stage)."""
