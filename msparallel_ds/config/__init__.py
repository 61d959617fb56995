"""Configuration front-end: MindFormers YAML -> validated, immutable ParallelConfig."""
from .errors import ConfigError, ConfigIssue, ConfigWarning
from .mindformers import load_config
from .schema import ParallelConfig

__all__ = ["ConfigError", "ConfigIssue", "ConfigWarning", "ParallelConfig", "load_config"]
