"""Recipe configs: YAML + CLI overrides, ``_component_`` instantiation and schema validation.

    cfg_path, overrides = parse_args()                 # --config x.yaml key=value +new=1 ~drop
    cfg = load_config(cfg_path, overrides)              # OmegaConf DictConfig
    algo = validate(cfg.algorithm, AlgorithmConfig, key="algorithm")
    optimizer = instantiate(cfg.optimizer, model.parameters())

Every problem raises `ConfigError` (a ValueError), never ``sys.exit``.
"""

from torchrlhf.config._errors import ConfigError
from torchrlhf.config._instantiate import get_component, instantiate, load_callable
from torchrlhf.config._parse import apply_overrides, load_config, parse_args
from torchrlhf.config._validate import as_section, schema_from_signature, validate

__all__ = ["ConfigError", "as_section", "apply_overrides", "get_component", "instantiate", "load_callable", "load_config", "parse_args", "schema_from_signature", "validate"]
