"""Factories for `model.name = "py:user_models.<module>:<function>"` in tests/test_user_model.py:
the user's own nn.Modules, imported from PYTHONPATH=tests (as a user's package would be)."""
