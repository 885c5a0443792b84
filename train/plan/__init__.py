"""Memory planning: the per-option estimate (`zerotrain plan`) and the check / --ds-config auto before a run."""
