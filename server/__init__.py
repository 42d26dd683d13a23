"""OpenAI-compatible HTTP server (Litestar); arrives with the server issue."""
