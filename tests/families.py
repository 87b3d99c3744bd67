"""Tiny random models of every family hybridlm reads, built by transformers from config objects
(independent of hybridlm), and the references that read them: transformers itself, llama.cpp's
converter (`convert_hf_to_gguf.py` with its own gguf-py) and llama.cpp's quantiser.

Vocabularies. The folders carry a byte-level BPE `tokenizer.json` trained with the tokenizers
library on a fixed text (300 tokens, the models' V), which hybridlm reads for a folder. llama.cpp's
converter identifies a BPE vocabulary by hashing its tokenisation of a test text against the
published models' (a tiny vocabulary matches none), so the converter is given the same weights
beside a SentencePiece `tokenizer.model` of 300 pieces trained on the same text (every family's
converter reads one). Neither vocabulary touches the logits compared here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from conftest import perturb_

V = 300
WINDOW = 8
TEXT = ("The quick brown fox jumps over the lazy dog. A hybrid system flows and jumps; tokens enter the state, "
        "which holds the keys and values of every layer and head. What is the capital of France? Paris is the "
        "capital of France. 0123456789 ÄÖÜ äöü ß € — “quotes” and 'quotes'.")


def _families():
    import transformers as T

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32, "rope_theta": 5000.0}
    longrope = {"rope_type": "longrope", "long_factor": [1.0 + 0.3 * i for i in range(8)],
                "short_factor": [1.0 + 0.05 * i for i in range(8)], "rope_theta": 10000.0}
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict()),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=24)),
        "llama3": (T.LlamaConfig, T.LlamaForCausalLM, dict(rope_scaling=llama3)),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=WINDOW)),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(ids)),
        "phi3.5": (T.Phi3Config, T.Phi3ForCausalLM, dict(ids, original_max_position_embeddings=32,
                                                         rope_scaling=longrope)),
        "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(ids, head_dim=24, sliding_window=WINDOW,
                                                             query_pre_attn_scalar=24)),
        "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(ids, head_dim=24, sliding_window=WINDOW,
                                                                  num_hidden_layers=7, query_pre_attn_scalar=24,
                                                                  final_logit_softcapping=15.0)),
    }


FAMILIES = ("qwen2", "qwen3", "llama3", "mistral", "phi3", "phi3.5", "gemma2", "gemma3")


def make_folder(name: str, folder: Path, *, seed: int = 0, wide: bool = False):
    """A random model of family `name` written by transformers into `folder` (config.json,
    model.safetensors, tokenizer.json). `wide`: rows of 256 (d = 256, d_mlp = 512), whose tensors
    llama.cpp can store in K-quant super-blocks. Returns the transformers model."""
    config_class, model_class, extra = _families()[name]
    sizes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 num_hidden_layers=2) if wide else dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                        num_key_value_heads=2, num_hidden_layers=3)
    if name.startswith("phi3") and wide:
        sizes.pop("head_dim")
    config = config_class(**{**dict(vocab_size=V, max_position_embeddings=128, initializer_range=0.08,
                                    attn_implementation="eager"), **sizes, **extra})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    perturb_(model)
    model.save_pretrained(folder)
    bpe_tokenizer().save(str(folder / "tokenizer.json"))
    return model


def reference(folder: Path, gguf_file: str | None = None):
    """transformers' model of a folder (or of a GGUF file inside it), eager attention, float32."""
    from transformers import AutoModelForCausalLM

    kwargs = {} if gguf_file is None else {"gguf_file": gguf_file}
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32,
                                                **kwargs).eval()


def bpe_tokenizer():
    """A byte-level BPE of V tokens trained on TEXT (tokenizers' trainer, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=V, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer)
    return tok


def spm_model() -> bytes:
    """A SentencePiece BPE model of V pieces trained on TEXT."""
    import io

    import sentencepiece as spm

    text = TEXT.replace("\n", " ")
    lines = [text[i : i + 80] for i in range(0, len(text), 7)] * 8
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=V, model_type="bpe",
                                   byte_fallback=False, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   num_threads=1, minloglevel=2)
    return model.getvalue()


_CONVERT = """
import sys, convert_hf_to_gguf as c
for folder, out in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", "f32"]
    c.main()
"""


def convert(source: Path, jobs: list[tuple[Path, Path]]) -> None:
    """llama.cpp's converter (from its source tree `source`) on each (folder, output file): the weights
    and config of the folder beside a SentencePiece tokenizer.model, float32 tensors."""
    model = spm_model()
    args = []
    for folder, out in jobs:
        staged = out.parent / f"{out.stem}-convert"
        staged.mkdir(parents=True, exist_ok=True)
        for file in ("config.json", "model.safetensors", "generation_config.json"):
            if (folder / file).is_file():
                shutil.copy(folder / file, staged / file)
        (staged / "tokenizer.model").write_bytes(model)
        config = {"add_bos_token": True, "tokenizer_class": "LlamaTokenizer"}  # (Phi-3's converter asks for a class)
        (staged / "tokenizer_config.json").write_text(json.dumps(config))
        args += [str(staged), str(out)]
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}  # (its own gguf-py, not the installed gguf)
    done = subprocess.run([sys.executable, "-c", _CONVERT, *args], cwd=source, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


_QUANTIZE = """
import ctypes, sys, llama_cpp
for source, out, kind in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + kind)
    params.nthread = 1
    if llama_cpp.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params)):
        sys.exit(f"quantising {source} as {kind} failed")
"""


def quantize(jobs: list[tuple[Path, Path, str]]) -> None:
    """llama.cpp's quantiser (llama_model_quantize of the installed binding) on each (F32 GGUF, output,
    file type such as "Q4_K_M"), in one process."""
    args = [str(x) for job in jobs for x in job]
    done = subprocess.run([sys.executable, "-c", _QUANTIZE, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def with_metadata(source: Path, out: Path, extra: dict, drop: tuple[str, ...] = ()) -> Path:
    """A copy of a GGUF file with metadata keys set (unsigned 32-bit integers) and tensors `drop`ped
    (gguf-py's reader and writer)."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in extra:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), kind)
    for key, value in extra.items():
        writer.add_uint32(key, value)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.shape.tolist()[::-1],
                              raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


_ARCH = {"qwen2": "QWEN2", "qwen3": "QWEN3", "llama3": "LLAMA", "mistral": "LLAMA", "phi3": "PHI3", "phi3.5": "PHI3",
         "gemma2": "GEMMA2", "gemma3": "GEMMA3"}


@torch.no_grad()
def dequantised_reference(folder: Path, gguf_path: Path, name: str):
    """transformers' model of the folder holding the weights of a (quantised) GGUF file: each parameter
    replaced by its tensor in the file (named by gguf-py's own table of Hugging Face names), dequantised
    by gguf-py, with the converter's changes undone (Llama's Q/K row order, Gemma's norm gains + 1)."""
    import gguf

    model = reference(folder)
    config = model.config
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _ARCH[name]), config.num_hidden_layers)
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        t = tensors[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))]
        value = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(param.shape)
        if _ARCH[name] == "LLAMA" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            value = value.reshape(heads, value.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(param.shape)
        if name.startswith("gemma") and hf_name.endswith("norm.weight"):
            value = value - 1
        param.copy_(value)
    return model
