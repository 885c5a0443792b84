"""The optimizer zerotrain builds for every strategy, its per-step learning rate, and the fp16 loss scale of any optimizer."""
