"""The drivers: the code that carries effects out, with threads or a loop."""
