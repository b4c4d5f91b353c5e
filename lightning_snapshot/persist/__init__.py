"""persist."""
