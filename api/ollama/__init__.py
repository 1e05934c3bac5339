"""Ollama's API on the same port: chat and generate (chat.py, /api/chat through the chat core),
embeddings (embed.py), the model routes (models.py), its request bodies (request.py) and its
NDJSON lines (lines.py)."""
