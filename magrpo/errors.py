"""Errors a user can fix; each message says what is wrong and how to fix it."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded; the message says which and why."""
