"""Checkpoints: the manager (save / resume / export), the file format, per-strategy state holders, HF weights."""
