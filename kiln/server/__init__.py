"""`kiln serve`: an OpenAI-compatible HTTP server over one engine worker (see docs/server.md)."""
