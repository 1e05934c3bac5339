"""The error tool calls raise: a request's tools that cannot be served for this model."""


class ToolCallError(ValueError):
    """Tools or a tool_choice this model's call format cannot serve; `param` names the request
    field at fault (serving answers it as a 400 naming that field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
