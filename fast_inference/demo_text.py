"""The demo model's text encoder: no weights, a fixed seeded vector per word of the demo captions' vocabulary.

Token i of a caption is row w_i of a word table plus row w_{i-1} of a second table (the word before it; a start row
for the first), both drawn once from a frozen NumPy stream of SEED. The pair carries what T5's context would:
"square" after "blue" differs from "square" after "red", so a colour binds to its shape within one token (the
model's text positions have zero RoPE rows, so it sees the prefix as an unordered set). The output is laid out as
T5's is after the official left padding: (B, T, caption_dim) with the real tokens last and zeros before them.
"""
import re

import numpy as np
import torch

from fast_inference.scenes import VOCABULARY
from fast_inference.text import TextError

SEED = 69
NAME = "demo-words"  # the safetensors metadata value naming this encoder in a GPT checkpoint


def words(prompt):
    """Lower-case words of a prompt; commas, full stops and the like are dropped."""
    return re.findall(r"[a-z]+", prompt.lower())


def tokenize(prompt, length):
    """A prompt -> vocabulary indices; one-line TextError for an unknown word or too many words."""
    ids = []
    for w in words(prompt):
        if w not in VOCABULARY:
            raise TextError(f"the demo model knows no {w!r}; its words are: {' '.join(VOCABULARY)}")
        ids.append(VOCABULARY.index(w))
    if not ids:
        raise TextError(f"empty prompt; describe the scene with the demo words: {' '.join(VOCABULARY)}")
    if len(ids) > length:
        raise TextError(f"the prompt has {len(ids)} words; the demo model reads at most {length}")
    return ids


class DemoTextEncoder:
    def __init__(self, dim, length, seed=SEED):
        rng = np.random.RandomState(seed)  # a stream NumPy keeps frozen: the same vectors on every machine
        V = len(VOCABULARY)
        self.word = torch.from_numpy(rng.standard_normal((V, dim)) / dim**0.5).float()
        self.before = torch.from_numpy(rng.standard_normal((V + 1, dim)) / dim**0.5).float()  # row V: the start
        self.dim, self.length = dim, length

    def encode_ids(self, ids):
        """Index lists -> (emb (B, T, dim) float32, mask (B, T) int64), left padded (in one gather: training encodes
        128 captions a step)."""
        pad = [[-1] * (self.length - len(row)) for row in ids]
        word = torch.tensor([p + row for p, row in zip(pad, ids)])
        before = torch.tensor([p + [len(VOCABULARY)] + row[:-1] for p, row in zip(pad, ids)])
        mask = (word >= 0).long()
        emb = self.word[word.clamp(min=0)] + self.before[before.clamp(min=0)]
        return torch.where(mask[..., None].bool(), emb, 0.0), mask

    def encode_left_padded(self, prompts):
        """Prompts (a str or a list of them) -> (emb, mask) as text.T5Encoder.encode_left_padded gives them."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        return self.encode_ids([tokenize(p, self.length) for p in prompts])
