import asyncio
import json

from . import sender_steps


class TritonPythonModel:
    """`sender` with an `async def execute`."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)

    async def execute(self, requests):
        await asyncio.sleep(0)
        return sender_steps.run(requests, self.decoupled)
