"""Diagnostics: the session report, timing, events and rendering. Imports no other layer."""
