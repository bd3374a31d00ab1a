"""Typed configuration: pydantic models, YAML files and `a.b=c` command-line overrides.

Every field has a description. Everything is validated before any work starts; an error
names the offending key and the reason. Batch sizes are derived: the user gives the
global batch (prompts × samples per prompt) and a token budget per micro-batch.

The parts, each a module of this package (every name but `doc`'s is imported from `tidal.config`):

- `section`: the base of every section (unknown keys refused);
- `task`: model, task, reward, rollout;
- `algorithm`: algorithm and its critic;
- `train`: train, with its lora, parallel and moe sections;
- `placement`: engine, placement (weight sync included), gateway;
- `run`: run, eval, alerts, and the names the monitors define;
- `tidal_config`: TidalConfig, the whole, and the checks across its sections;
- `load`: YAML files and overrides into a validated TidalConfig, with errors that name the key;
- `resume`: the config a run directory keeps and what a resume may change;
- `doc`: every key with its type, default and description, for `tidal config` and docs/config.md
  (imported as `tidal.config.doc`: the reference of a config, not a part of one).
"""

from tidal.config.algorithm import AlgorithmConfig, CriticConfig
from tidal.config.load import ConfigError, all_keys, did_you_mean, load_config, parse_overrides, section_keys
from tidal.config.placement import EngineConfig, GatewayConfig, PlacementConfig, RoleResources, WeightSyncDeltaConfig
from tidal.config.resume import RESUME_NEUTRAL, RESUME_REFUSED, config_diff, dump_config, load_resume_config
from tidal.config.run import ALERTS, HACKING_KINDS, SINK_EXTRAS, AlertsConfig, EvalConfig, RunConfig
from tidal.config.task import AGENT_ENVS, ModelConfig, RewardConfig, RewardSpec, RolloutConfig, TaskConfig
from tidal.config.tidal_config import TidalConfig
from tidal.config.train import LoraConfig, MoeConfig, ParallelConfig, TrainConfig

__all__ = [
    "AGENT_ENVS", "ALERTS", "HACKING_KINDS", "RESUME_NEUTRAL", "RESUME_REFUSED", "SINK_EXTRAS",
    "AlertsConfig", "AlgorithmConfig", "ConfigError", "CriticConfig", "EngineConfig", "EvalConfig",
    "GatewayConfig", "LoraConfig", "ModelConfig", "MoeConfig", "ParallelConfig", "PlacementConfig",
    "RewardConfig", "RewardSpec", "RoleResources", "RolloutConfig", "RunConfig", "TaskConfig",
    "TidalConfig", "TrainConfig", "WeightSyncDeltaConfig",
    "all_keys", "config_diff", "did_you_mean", "dump_config", "load_config", "load_resume_config",
    "parse_overrides", "section_keys",
]
