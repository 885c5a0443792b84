"""The run configuration: a typed dataclass tree loaded strictly from JSON/YAML.

Order of precedence: dataclass defaults < run file (``--config run.yaml``) < dotted
CLI overrides (``--optim.lr 3e-4``). Unknown keys, wrong types and impossible values
fail with a ConfigError naming the key. DeepSpeed/ZeRO/precision settings are *not*
here: they live in the DeepSpeed JSON (``distributed.ds_config``), see train/strategy/ds_config.py.

schema.py (+ data_section.py, and models/config.py for model:) the sections, loader.py the
strict loading, moved.py the keys that moved between sections, batch.py the batch arithmetic;
the names other modules use are re-exported here.
"""

from zerotrain.models.config import GptModel, HfModel, LinearModel, LoraConfig, ModelConfig, ModelSection, PyModel, VisionModel
from zerotrain.train.config.batch import Batch
from zerotrain.train.config.data_section import (DATA_KINDS, DataConfig, DataSection, ImageFolderData, RegressionData,
                                       PreferenceData, PyData, SftData, SourceConfig, StreamData, TextData,
                                       TokensData)
from zerotrain.train.config.loader import load_config, read_mapping
from zerotrain.train.config.moved import upgrade_saved
from zerotrain.train.config.schema import (CheckpointConfig, DebugConfig, DistributedConfig, HardwareConfig, LoggingConfig,
                                 DpoConfig, OptimConfig, RunConfig, TrainConfig, WandbConfig)

__all__ = ["Batch", "CheckpointConfig", "DATA_KINDS", "DataConfig", "DataSection", "DebugConfig", "DistributedConfig", "DpoConfig",
           "GptModel", "HardwareConfig", "HfModel", "ImageFolderData", "LinearModel", "LoggingConfig", "LoraConfig",
           "ModelConfig", "ModelSection", "OptimConfig", "PreferenceData", "PyData", "PyModel", "RegressionData", "RunConfig", "SftData",
           "SourceConfig", "StreamData", "TextData", "TokensData", "TrainConfig", "VisionModel", "WandbConfig",
           "load_config", "read_mapping", "upgrade_saved"]
