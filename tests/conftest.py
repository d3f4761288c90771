"""Test-suite root.

This file only makes ``tests/`` importable (pytest puts the folder of a rootdir conftest on
``sys.path``), so any test can ``from helpers import make_tiny_model, ...``.
"""
