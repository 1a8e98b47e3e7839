"""The one error type for bad user input: the CLI prints it as one line and exits 2."""


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
