"""engine_adapter."""
