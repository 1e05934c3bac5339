"""OpenAI's APIs: /v1/chat/completions (chat.py), /v1/completions (completions.py) and
/v1/responses (responses*.py), each a translation onto the serving core."""
