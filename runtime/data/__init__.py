"""Built-in data sources."""
