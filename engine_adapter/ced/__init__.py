"""engine_adapter/ced."""
