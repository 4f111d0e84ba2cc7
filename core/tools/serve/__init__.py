"""`speckernel serve`: an OpenAI-compatible HTTP server over AsyncEngine."""
