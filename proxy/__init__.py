"""polyinfer proxy."""
