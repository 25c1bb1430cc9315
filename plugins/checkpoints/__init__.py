"""Checkpoints: pickle-free atomic saves, rotation, resume, the best model and ``save_model``."""
