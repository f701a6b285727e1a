"""Prefix-affinity routing across replicas (issue 45): three Ray Serve replicas, each an
in-process wasmtron serving the `smollm2` pipeline, asked many short turns on a few long system
prompts (six of about 450 tokens, each replica's prefix cache holding two) — once with Serve's
default router (power of two choices) and once with Ray's
`PrefixCacheAffinityRouter`, which sends a prompt to the replica that saw its beginning.
Reports, per router, the prefix-cache hit rate summed over the replicas (wasmtron's
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, prompt tokens) and the
time to the first token (p50, p90: requests for one token, timed at the client through the
handle).

    python benches/ray_prefix_affinity.py [turns per prompt]   # in a loopback-only netns

Ray listens beyond loopback unless it runs in a network namespace that has only `lo`
(deploy/ray/README.md): `ip netns add b; ip netns exec b ip link set lo up;
ip netns exec b .venv/bin/python benches/ray_prefix_affinity.py`.
"""
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

import wasmtron

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Ray's own router (`ray.serve.llm.request_router.PrefixCacheAffinityRouter` re-exports it, but
# that package needs vLLM or SGLang installed).
AFFINITY = ("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router."
            "PrefixCacheAffinityRouter")
SUBJECTS = ["a bakery", "a railway museum", "a mountain hut", "a public library",
            "a ferry company", "a botanical garden"]
# Each replica's prefix cache holds four prompts (about 460 tokens each): not all six.
CACHE_TOKENS = 2000


def system_prompt(subject, rng):
    """A long system prompt (about 400 tokens) about `subject`."""
    facts = [f"Fact {i} about {subject}: it keeps {rng.randrange(2, 90)} "
             f"{rng.choice(['shelves', 'rooms', 'benches', 'lamps', 'clocks'])} and opens at "
             f"{rng.randrange(5, 11)} in the morning on {rng.choice(['weekdays', 'weekends'])}."
             for i in range(20)]
    return (f"You are the assistant of {subject}. Answer in one short sentence, never invent "
            "facts, and use only what follows. " + " ".join(facts) + "\n")


@dataclass
class Turn:
    """One request: the router reads `.prompt`."""
    prompt: str


@serve.deployment(num_replicas=3, ray_actor_options={"num_cpus": 0})
class Chat:
    def __init__(self, repository):
        self.server = wasmtron.Server(
            model_repository=repository,
            model_control_mode=wasmtron.ModelControlMode.EXPLICIT,
            startup_models=["smollm2"]).start(wait_until_ready=True)
        self.id = serve.get_replica_context().replica_id.unique_id

    async def generate(self, turn: Turn) -> str:
        async for response in self.server.model("smollm2").async_infer(
                inputs={"text_input": [[turn.prompt]], "max_tokens": [[1]]}):
            pass
        return self.id

    def counters(self):
        text = self.server.metrics()

        def total(name):
            return sum(float(v) for v in re.findall(
                rf'^{re.escape(name)}{{[^}}]*model="smollm2_decoder"[^}}]*}} (\S+)$', text, re.M))
        return self.id, total("vllm:prefix_cache_hits_total"), total(
            "vllm:prefix_cache_queries_total")


def repository_with_cache(tokens):
    """A repository holding the smollm2 pipeline whose decoder keeps `tokens` prompt tokens
    for prefix caching: fewer than all the system prompts, as on a server whose prompts
    outnumber its cache (ONNX files linked, not copied)."""
    import shutil
    import tempfile
    repo = tempfile.mkdtemp(prefix="wt_affinity_")
    for name in ("smollm2", "smollm2_decoder", "llm_preprocessing", "llm_postprocessing"):
        source = os.path.join(ROOT, "model_repository", name)
        for dirpath, _, files in os.walk(source):
            dest = os.path.join(repo, name, os.path.relpath(dirpath, source))
            os.makedirs(dest, exist_ok=True)
            for f in files:
                path = os.path.join(dirpath, f)
                # Stages read their folder in the sandbox, which follows no links.
                if f.endswith((".onnx", ".onnx.data")):
                    os.symlink(os.path.realpath(path), os.path.join(dest, f))
                else:
                    shutil.copy(path, os.path.join(dest, f))
    with open(os.path.join(repo, "smollm2_decoder", "config.pbtxt"), "a") as f:
        f.write('parameters { key: "prefix_cache_max_tokens" value { string_value: "%d" } }\n'
                % tokens)
    return repo


def run(router, turns_per_prompt, repository):
    config = RequestRouterConfig(
        request_router_class=router) if router else RequestRouterConfig()
    # An application of its own per router: a handle keeps the router it first made for a
    # deployment's name.
    app = "chat_affinity" if router else "chat_default"
    handle = serve.run(Chat.options(request_router_config=config).bind(repository),
                       name=app, route_prefix=None)
    rng = random.Random(11)
    prompts = [system_prompt(s, rng) for s in SUBJECTS]
    questions = ["When does it open?", "How many rooms are there?", "Is it open on weekends?",
                 "What should I bring?", "Who can visit?", "Is there a cafe?"]
    work = [(p, rng.choice(questions)) for p in prompts for _ in range(turns_per_prompt)]
    rng.shuffle(work)
    # Warm each replica (its first request pays for loading, not for routing).
    for _ in range(12):
        handle.generate.remote(Turn("Hello.")).result(timeout_s=600)
    before = replica_counters(handle)
    latencies = []
    replicas_of_prompt = {}

    async def client(queue):
        while queue:
            system, question = queue.pop()
            started = time.perf_counter()
            replica = await handle.generate.remote(Turn(system + "User: " + question + "\n"))
            latencies.append(time.perf_counter() - started)
            replicas_of_prompt.setdefault(system, set()).add(replica)

    async def main():
        queue = list(work)
        await asyncio.gather(*(client(queue) for _ in range(2)))

    asyncio.run(main())
    after = replica_counters(handle)
    hits = sum(after[r][0] - before.get(r, (0, 0))[0] for r in after)
    queries = sum(after[r][1] - before.get(r, (0, 0))[1] for r in after)
    serve.delete(app)
    latencies.sort()
    return {
        "router": "PrefixCacheAffinityRouter" if router else "PowerOfTwoChoices (default)",
        "requests": len(latencies),
        "hit_rate": round(hits / queries, 3) if queries else None,
        "ttft_p50_s": round(statistics.median(latencies), 3),
        "ttft_p90_s": round(latencies[int(0.9 * (len(latencies) - 1))], 3),
        "replicas_per_prompt": round(statistics.mean(len(v) for v in replicas_of_prompt.values()), 2),
        "prompts_per_replica": sorted(
            sum(1 for v in replicas_of_prompt.values() if r in v) for r in after),
    }


def replica_counters(handle):
    seen = {}
    for _ in range(200):
        replica, hits, queries = handle.counters.remote().result(timeout_s=60)
        seen[replica] = (hits, queries)
        if len(seen) == 3:
            break
    return seen


if __name__ == "__main__":
    turns = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    ray.init(num_cpus=2, include_dashboard=False)
    repository = repository_with_cache(CACHE_TOKENS)
    results = [run(None, turns, repository),
               run(AFFINITY, turns, repository)]
    ray.shutdown()
    for r in results:
        print(json.dumps(r))
