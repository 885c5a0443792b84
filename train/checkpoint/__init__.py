"""Checkpoints: the manager (save / resume / init_from), the live export, the file format, per-strategy state
holders, HF weights, and `zerotrain import`'s reader of foreign checkpoints."""
