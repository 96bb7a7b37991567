"""proto."""
