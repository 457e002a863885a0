"""OpenAI-compatible HTTP server on AsyncLLM: `inferno serve`."""
