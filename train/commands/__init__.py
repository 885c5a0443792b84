"""`zerotrain <command>` implementations, one module each (train/cli.py dispatches)."""
