"""The one error type for bad user input (the CLI prints it as one line and exits 2), and the
infeasibility of a layout, which the trainer raises and the planner lists."""

import dataclasses


class ConfigError(ValueError):
    """A user-facing configuration error naming the offending field.

    Args:
      field: dotted config path (``"mesh.data"``) or CLI flag (``"--config"``).
      message: what is wrong and what would be valid.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def within(self, section: str) -> "ConfigError":
        """The same error with its field prefixed by ``section`` (``"train"`` + ``"steps"``)."""
        return ConfigError(f"{section}.{self.field}", self.message)


@dataclasses.dataclass(frozen=True)
class Infeasible:
    """Why a layout cannot be built: the ``ConfigError`` the trainer raises (``field``, ``message``)
    and the short ``reason`` the planner prints in its table."""

    field: str
    message: str
    reason: str

    def error(self) -> ConfigError:
        return ConfigError(self.field, self.message)
