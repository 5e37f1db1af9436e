"""Proposer agents: each reads a BoardView and proposes candidate configs."""
