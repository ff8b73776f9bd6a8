"""Offline analysis of moetrace traces."""
