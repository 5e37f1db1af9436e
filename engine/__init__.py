"""polyinfer engine."""
