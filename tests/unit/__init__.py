"""Unit tests: pure logic, no database."""
