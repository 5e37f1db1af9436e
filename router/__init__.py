"""polyinfer router."""
