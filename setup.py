"""The package map pyproject.toml cannot express: the top-level folders train/, models/ and
ds_configs/ install as zerotrain.train, zerotrain.models and zerotrain.ds_configs (zerotrain
itself is a namespace package: no __init__.py of its own), so an installed zerotrain never
shadows a user's own `models` or `train` package. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

FOLDERS = ("train", "models", "ds_configs")

setup(
    packages=["zerotrain." + p for p in find_packages(include=["train", "train.*", "models", "models.*"])]
    + ["zerotrain.ds_configs", "zerotrain.ds_configs.accelerate"],  # data only: JSONs and YAMLs
    package_dir={f"zerotrain.{f}": f for f in FOLDERS},
)
