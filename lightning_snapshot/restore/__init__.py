"""restore."""
