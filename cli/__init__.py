"""moetrace command line (typer app)."""
