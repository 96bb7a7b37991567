"""statestore."""
