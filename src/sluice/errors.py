"""Errors a user can cause. The CLI prints their message and exits with status 2."""


class SluiceError(Exception):
    """Base class: the message says what is wrong and what to do about it."""


class ModelFileError(SluiceError):
    """A model file or directory is missing, truncated or corrupt."""


class UnsupportedError(SluiceError):
    """An architecture, tensor type or feature sluice does not support (yet)."""


class ContextLengthError(SluiceError):
    """A prompt (plus the tokens to generate) does not fit the context window."""


class InvalidOptionError(SluiceError):
    """An option is out of range or of the wrong kind."""


class DownloadError(SluiceError):
    """The demo model could not be fetched."""
