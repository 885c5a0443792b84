"""Factories that break the contract (tests/test_user_model.py: each a one-line refusal)."""


def not_a_module(**kwargs):
    return {"weights": [1.0, 2.0]}
