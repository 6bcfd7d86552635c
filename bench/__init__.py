"""Benchmarks: measured, never asserted. Each prints the command that produced its figures."""
