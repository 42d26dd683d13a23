"""The OpenAI-compatible HTTP server (Litestar) in front of the engine."""

from server.app import create_app

__all__ = ["create_app"]
