"""The one error a config that cannot run raises."""


class ConfigError(ValueError):
    """A config that cannot run; the message says which field and what to do."""
