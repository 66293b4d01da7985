"""The decisions: rows, inputs, the planner and its guards; no I/O, no clock."""
