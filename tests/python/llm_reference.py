"""An independent NumPy forward pass of a llama GGUF file, for checking the ONNX conversion.

It shares nothing with scripts/llm_export.py but the `gguf` package's dequantisation: it keeps
llama.cpp's row order of the Q/K weights and applies rotary embedding the way llama.cpp does
(rotating adjacent pairs), recomputes attention over the whole sequence at every step (no
cache), and repeats KV heads instead of grouping queries.
"""
import gguf
import numpy as np


class GgufLlama:
    def __init__(self, path):
        reader = gguf.GGUFReader(path)
        field = lambda key: reader.fields[key].contents()  # noqa: E731
        self.layers = int(field("llama.block_count"))
        self.heads = int(field("llama.attention.head_count"))
        self.kv_heads = int(field("llama.attention.head_count_kv"))
        self.base = float(field("llama.rope.freq_base"))
        self.eps = float(field("llama.attention.layer_norm_rms_epsilon"))
        self.t = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
                  for t in reader.tensors}
        self.dim = self.t["token_embd.weight"].shape[1] // self.heads

    def _norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x):
        # x [seq, heads, dim]; pairs (2i, 2i+1) rotate by pos * base^(-2i/dim).
        seq, _, dim = x.shape
        theta = np.arange(seq)[:, None] * self.base ** (-np.arange(0, dim, 2) / dim)[None, :]
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def logits(self, ids):
        """Logits of the last position for the token sequence `ids` (float64 throughout)."""
        t = self.t
        x = t["token_embd.weight"][ids]
        seq = len(ids)
        mask = np.triu(np.full((seq, seq), -np.inf), 1)
        for i in range(self.layers):
            p = f"blk.{i}."
            h = self._norm(x, t[p + "attn_norm.weight"])
            q = self._rope((h @ t[p + "attn_q.weight"].T).reshape(seq, self.heads, self.dim))
            k = self._rope((h @ t[p + "attn_k.weight"].T).reshape(seq, self.kv_heads, self.dim))
            v = (h @ t[p + "attn_v.weight"].T).reshape(seq, self.kv_heads, self.dim)
            rep = self.heads // self.kv_heads
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(self.dim) + mask
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probs = scores / scores.sum(-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(seq, -1)
            x = x + attn @ t[p + "attn_output.weight"].T
            h = self._norm(x, t[p + "ffn_norm.weight"])
            gate = h @ t[p + "ffn_gate.weight"].T
            x = x + ((gate / (1 + np.exp(-gate))) * (h @ t[p + "ffn_up.weight"].T)) @ t[p + "ffn_down.weight"].T
        x = self._norm(x[-1], t["output_norm.weight"])
        head = t.get("output.weight", t["token_embd.weight"])
        return head @ x

    def greedy(self, ids, count):
        ids = list(ids)
        out = []
        for _ in range(count):
            nxt = int(np.argmax(self.logits(ids)))
            out.append(nxt)
            ids.append(nxt)
        return out
