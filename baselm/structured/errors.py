"""The error structured output raises: a grammar a request asks for that cannot be enforced."""


class StructuredOutputError(ValueError):
    """A schema, grammar or sampling setting that the answer's grammar cannot be enforced with;
    `param` names the request field at fault (serving answers it as a 400 naming that field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
