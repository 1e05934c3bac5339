"""Ollama's API on the same port: chat, generate and embeddings (chat.py), the model routes (models.py),
and its request bodies (request.py)."""
