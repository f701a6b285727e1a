"""Never runs: its environment's package holds a native extension module."""
import fastthing  # noqa: F401


class TritonPythonModel:
    def execute(self, requests):
        return []
