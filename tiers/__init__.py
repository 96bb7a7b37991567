"""tiers."""
