"""polyinfer loadgen."""
