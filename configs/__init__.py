"""Experiment configs: one `get_config()` per file (ml_collections), see configs/common.py."""
