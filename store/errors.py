"""Errors the store raises: each says what is wrong with which file and what to do."""


class StoreError(Exception):
    """Base of the store's errors; its message is meant for the person at the terminal."""


class UnsupportedModelError(StoreError):
    """The model's architecture or tensor type is not one base can run."""


class ModelFileError(StoreError):
    """A model file or folder is missing, incomplete or malformed."""
