"""Attention backends; each registers its name in astrai.infer.backend.BACKENDS."""
