"""The run's schema: the ground floor every process stands on.

    root.py        DrmasConfig (what one deployment needs) and its small sections
    actor.py ...   each component's own section (actor, broker, learner, model, task,
                   retrieval, transport, checkpoint, placement)
    load.py        load_config: hydra composes configs/ + overrides, converted once
    rules.py       the rules that span fields (one field's range or choice is declared
                   on the field itself and checked while converting)
    schema.py      option keys and their docs (`drmas config`, typo hints)

Building a config imports no team, tool, reward or tracker: resolving those is a separate
step (drmas/plugins.py) that only the roles needing them take. No torch import here.
"""

from drmas.config.errors import ConfigError
from drmas.config.load import config_dict, config_dir, load_config, to_yaml
from drmas.config.root import AgentConfig, DrmasConfig

__all__ = [
    "AgentConfig",
    "ConfigError",
    "DrmasConfig",
    "config_dict",
    "config_dir",
    "load_config",
    "to_yaml",
]
