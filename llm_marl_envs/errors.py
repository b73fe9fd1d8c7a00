"""Errors a user can cause; each message is one paragraph: what is wrong and how to fix it."""


class LLMMarlEnvError(Exception):
    """Base class: catch this to report any user-caused environment error."""


class UnknownEnvError(LLMMarlEnvError, KeyError):
    """An environment id that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class DeprecatedEnvError(UnknownEnvError):
    """A retired version of an environment id; the message names the id that replaced it."""


class DataUnavailableError(LLMMarlEnvError):
    """A dataset that cannot be reached (offline Hub, missing file)."""


class DataFormatError(LLMMarlEnvError, ValueError):
    """A dataset that was read but does not have the fields a task needs."""


class ConfigError(LLMMarlEnvError, ValueError):
    """An environment option with a bad value."""
