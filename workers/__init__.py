"""Streaming runtimes: rollout workers (ring -> ZMQ) and training-rank step reports."""
