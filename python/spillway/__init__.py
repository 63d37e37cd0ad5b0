"""Spillway: plan and run tensor offload between GPU memory and pinned host memory.

The FX graph exporter lives in spillway.fx_export (it imports torch lazily, so
importing spillway alone stays cheap).
"""

__version__ = "0.1.0"
