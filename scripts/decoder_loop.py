"""Greedy decoding with ONNX Runtime called directly, for the decoders `llm_export.py` writes in
either layout: the growing cache (Optimum's: `position_ids`, each run answers a present one
column longer, fed back as the next past) and the shared buffer (ONNX Runtime GenAI's
`past_present_share_buffer`: one buffer per cache tensor bound through IO binding as past and
present, written in place; rows right-padded, lengths from the attention mask).

The reference the tests compare the server with, the limit the benches measure it against, and
the loop of the Triton python-backend twin.
"""
import numpy as np
import onnxruntime as ort


class DecoderLoop:
    def __init__(self, path, threads=None, lora=None):
        """`lora`: for a decoder that takes adapters (`llm_export.py --lora`), the inputs
        `lora.{i}.{p}.a|b` of the adapters to run and a function of the batch's rows answering
        `lora_mask`; without it, one column of zeros (the base model)."""
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        inputs = self.session.get_inputs()
        self.pasts = [i for i in inputs if i.name.startswith("past_key_values.")]
        self.shared = not any(i.name == "position_ids" for i in inputs)
        self.outputs = [o.name for o in self.session.get_outputs()]
        # Exports that can answer every position's logits take `all_logits` (0: the last only).
        self.switch = {"all_logits": np.array(0, np.int64)} if any(
            i.name == "all_logits" for i in inputs) else {}
        self.adapters = {}
        self.lora_mask = None
        if any(i.name == "lora_mask" for i in inputs):
            self.adapters = {i.name: np.zeros([1 if isinstance(d, str) else d for d in i.shape], np.float32)
                             for i in inputs if i.name.startswith("lora.")}
            self.lora_mask = lambda rows: np.zeros((rows, 1, 1), np.float32)
            if lora is not None:
                self.adapters, self.lora_mask = lora

    def _adapter_feeds(self, rows):
        if self.lora_mask is None:
            return {}
        return {**self.adapters, "lora_mask": self.lora_mask(rows)}

    def prompt_log_probs(self, prompt, top=0):
        """Each prompt token's natural-log probability given the ones before it (the first has
        none: None), and with `top` the `top` likeliest tokens at each position as (token,
        log-probability) pairs (before the first token: none), from one run over the prompt."""
        if not self.switch:
            raise ValueError("this decoder does not answer every position's logits")
        n = len(prompt)
        feeds = {p.name: np.zeros((1, p.shape[1], 0 if not self.shared else n, p.shape[3]),
                                  np.float16 if p.type == "tensor(float16)" else np.float32)
                 for p in self.pasts}
        feeds.update(input_ids=np.array([prompt], np.int64), attention_mask=np.ones((1, n), np.int64),
                     all_logits=np.array(1, np.int64), **self._adapter_feeds(1))
        if not self.shared:
            feeds["position_ids"] = np.arange(n, dtype=np.int64)[None]
        logits = self.session.run(["logits"], feeds)[0][0].astype(np.float64)
        log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        values = [None] + [float(log_probs[i - 1, prompt[i]]) for i in range(1, n)]
        tops = [[]] + [[(int(t), float(log_probs[i - 1, t])) for t in np.argsort(-log_probs[i - 1], kind="stable")[:top]]
                       for i in range(1, n)]
        return values, tops

    def greedy(self, prompts, count, end_ids=(), on_step=None):
        """The greedy tokens of each prompt (a list of token lists; of one length for the
        growing layout), `count` at most or until an end token (not included).
        `on_step(tokens)` is called after each run with the token each row chose."""
        run = self._shared if self.shared else self._growing
        out = [[] for _ in prompts]
        done = [False] * len(prompts)
        for tokens in run(prompts, count):
            if on_step is not None:
                on_step(tokens)
            for r, t in enumerate(tokens):
                if not done[r]:
                    if t in end_ids:
                        done[r] = True
                    else:
                        out[r].append(t)
            if all(done):
                break
        return out

    def _growing(self, prompts, count):
        b, n = len(prompts), len(prompts[0])
        if any(len(p) != n for p in prompts):
            raise ValueError("the growing layout runs prompts of one length together")
        feeds = {p.name: np.zeros((b, p.shape[1], 0, p.shape[3]), np.float32) for p in self.pasts}
        feeds.update(input_ids=np.array(prompts, np.int64), attention_mask=np.ones((b, n), np.int64),
                     position_ids=np.tile(np.arange(n), (b, 1)).astype(np.int64), **self.switch)
        total = n
        for _ in range(count):
            results = dict(zip(self.outputs, self.session.run(None, feeds)))
            tokens = np.argmax(results["logits"][:, -1], axis=-1)
            yield [int(t) for t in tokens]
            for p in self.pasts:
                feeds[p.name] = results[p.name.replace("past_key_values", "present")]
            total += 1
            feeds.update(input_ids=tokens[:, None].astype(np.int64),
                         attention_mask=np.ones((b, total), np.int64),
                         position_ids=np.full((b, 1), total - 1, np.int64))

    def _shared(self, prompts, count):
        b = len(prompts)
        lens = [len(p) for p in prompts]
        columns = max(lens) + count
        binding = self.session.io_binding()
        binding.bind_output("logits")
        for name, value in {**self.switch, **self._adapter_feeds(b)}.items():
            binding.bind_cpu_input(name, value)
        for p in self.pasts:
            dtype = np.float16 if p.type == "tensor(float16)" else np.float32
            buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros((b, p.shape[1], columns, p.shape[3]), dtype))
            binding.bind_ortvalue_input(p.name, buffer)
            binding.bind_ortvalue_output(p.name.replace("past_key_values", "present"), buffer)
        width = max(lens)
        ids = np.zeros((b, width), np.int64)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = p
        for _ in range(count):
            mask = np.zeros((b, max(lens)), np.int64)
            for r, n in enumerate(lens):
                mask[r, :n] = 1
            binding.bind_cpu_input("input_ids", ids)
            binding.bind_cpu_input("attention_mask", mask)
            self.session.run_with_iobinding(binding)
            tokens = np.argmax(binding.copy_outputs_to_cpu()[0][:, -1], axis=-1)
            yield [int(t) for t in tokens]
            ids = tokens[:, None].astype(np.int64)
            lens = [n + 1 for n in lens]


def greedy(path, ids, count, end_ids=()):
    """One prompt's greedy tokens."""
    return DecoderLoop(path).greedy([list(ids)], count, end_ids)[0]
