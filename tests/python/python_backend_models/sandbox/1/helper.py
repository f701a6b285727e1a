"""A module beside model.py, imported as Triton users do."""
GREETING = "hello from helper"
