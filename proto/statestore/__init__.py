"""Generated protobuf modules of the statestore.v1 wire contract (see v1/*.proto)."""
