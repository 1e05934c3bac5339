"""The errors tokenizers raise; each message says what is wrong."""


class TokenizerError(Exception):
    """A tokenizer that cannot be built or used; the message says what is wrong."""


class ChatTemplateError(TokenizerError):
    """A chat template that is missing, invalid, or refuses the given conversation."""
