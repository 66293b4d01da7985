"""Fault-injection scenarios: kills, restarts, terminated connections, stalls and races."""
