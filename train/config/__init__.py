"""The run configuration: a typed dataclass tree loaded strictly from JSON/YAML.

Order of precedence: dataclass defaults < run file (``--config run.yaml``) < dotted
CLI overrides (``--optim.lr 3e-4``). Unknown keys, wrong types and impossible values
fail with a ConfigError naming the key. DeepSpeed/ZeRO/precision settings are *not*
here: they live in the DeepSpeed JSON (``distributed.ds_config``), see train/strategy/ds_config.py.

schema.py (+ data_section.py) the sections, loader.py the strict loading, batch.py the batch
arithmetic; the names other modules use are re-exported here.
"""

from zerotrain.models.config import ModelConfig
from zerotrain.train.config.batch import Batch
from zerotrain.train.config.data_section import DataConfig, SourceConfig
from zerotrain.train.config.loader import load_config, read_mapping
from zerotrain.train.config.schema import (CheckpointConfig, DistributedConfig, LoggingConfig, OptimConfig, RunConfig,
                                 TrainConfig, WandbConfig)

__all__ = ["Batch", "CheckpointConfig", "DataConfig", "DistributedConfig", "LoggingConfig", "ModelConfig",
           "OptimConfig", "RunConfig", "SourceConfig", "TrainConfig", "WandbConfig", "load_config", "read_mapping"]
