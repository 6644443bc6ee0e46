"""Serving policies (pure): admission against a latency SLO."""
