"""The one error type of config validation (a leaf: every config module imports it)."""


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field and the fix."""


def require(cond: bool, msg: str) -> None:
  if not cond:
    raise ConfigError(msg)
