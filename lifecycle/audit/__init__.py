"""Offline audit tooling: replay audit logs against the transition table, render reports and diagrams.

Reads JSON-lines logs written by `lifecycle.events`; imports nothing of the core but the table (`lifecycle.states`).
"""
