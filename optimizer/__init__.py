"""polyinfer optimizer."""
