"""zdsl.runtime: the executor. The only part of zdsl that imports torch."""
