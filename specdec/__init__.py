"""polyinfer specdec."""
