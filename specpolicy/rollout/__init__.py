"""Draft-confidence features (one definition for decoding and collection) and rollout collection."""
