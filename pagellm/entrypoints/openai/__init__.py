"""The OpenAI-compatible HTTP server (``pagellm serve``)."""
