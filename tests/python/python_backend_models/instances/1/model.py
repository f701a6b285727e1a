"""Says which instance answered, what it drew from `random` and `numpy.random` in
`initialize`, and how many requests its module-level list has seen: instances started from one
snapshot of the import must each draw their own numbers and keep their own state."""
import json
import random
import time

import numpy as np
import triton_python_backend_utils as pb_utils

SEEN = []  # module state, per interpreter
DRAWN_AT_IMPORT = random.getrandbits(64)


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]
        self.drawn = random.getrandbits(64)
        self.np_drawn = int(np.random.randint(0, 2**31 - 1))

    def execute(self, requests):
        out = []
        for _ in requests:
            SEEN.append(1)
            time.sleep(0.3)  # long enough for concurrent requests to reach other instances
            about = json.dumps({"instance": self.name, "drawn": self.drawn,
                                "np_drawn": self.np_drawn, "seen": len(SEEN)})
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("ABOUT", np.array([about.encode()], dtype=np.object_))]))
        return out
