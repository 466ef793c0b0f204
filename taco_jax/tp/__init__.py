"""3D-parallel (data, pipeline, tensor) GPT training: mesh, TP/SP layers, GPipe, train step.

See docs/parallel.md for the layout and which collective runs where.
"""
