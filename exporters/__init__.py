"""Exporters: Prometheus and OpenTelemetry."""
