"""Coordinator: supervises the worker processes, runs the fetch/compute policy, serves the APIs."""
