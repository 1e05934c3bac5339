"""Errors the store raises: each says what is wrong with which file and what to do."""


class StoreError(Exception):
    """Base of the store's errors; its message is meant for the person at the terminal."""


class UnsupportedModelError(StoreError):
    """The model's architecture or tensor type is not one base can run."""


class ModelFileError(StoreError):
    """A model file or folder is missing, incomplete or malformed."""


class BaseFileError(ModelFileError):
    """A `.base` file fails validation: bad magic, header, layout or checksum.

    `path` and `problem` are kept apart so callers can show either; the message joins them.
    """

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path} is not a usable .base file: {problem}; convert or pull the model again")
        self.path = path
        self.problem = problem


class ProfileError(StoreError):
    """A quantization profile (built-in name or JSON file) is unknown or malformed."""


class QuantizationError(StoreError):
    """A tensor cannot be quantized as asked (non-finite values, scale overflow, bad shape)."""


class SignatureError(StoreError):
    """A model's signature is missing, malformed, untrusted, or does not match the file."""
