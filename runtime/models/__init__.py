"""Built-in models (units protocol)."""
