import asyncio
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Echoes X; its `is_ready()` answers as the READY parameter says (true, false, raise,
    text), after sleeping READY_DELAY seconds. READY "async" makes a coroutine of it."""

    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.ready = params.get("READY", {}).get("string_value", "true")
        self.delay = float(params.get("READY_DELAY", {}).get("string_value", "0"))
        if self.ready == "async":
            self.is_ready = self._ready_later

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]

    def is_ready(self):
        time.sleep(self.delay)
        if self.ready == "raise":
            raise RuntimeError("not today")
        if self.ready == "text":
            return "yes"
        return self.ready == "true"

    async def _ready_later(self):
        await asyncio.sleep(self.delay)
        return True
