"""Write the seed corpora (corpus/<harness>/): small, valid inputs of each reader, a few KB each.

Run from the repository root: python fuzz/make_seeds.py
"""

import json
import struct
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).parent / "corpus"


def write(harness: str, name: str, data: bytes) -> None:
    folder = ROOT / harness
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)


def tiny_gguf(path: Path, *, tensors: bool) -> bytes:
    """A one-block Llama: d = 32, 2 heads (1 key/value head), V = 8, matrices in Q8_0."""
    d, d_mlp, vocab, heads, kv = 32, 32, 8, 2, 1
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(16)
    writer.add_embedding_length(d)
    writer.add_block_count(1)
    writer.add_feed_forward_length(d_mlp)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab", "c", "<|im_start|>", "<|im_end|>", "d", "e"])
    writer.add_token_types([1, 1, 1, 1, 3, 3, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(5)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    if tensors:
        d_head = d // heads
        shapes = {"token_embd.weight": (vocab, d), "blk.0.attn_q.weight": (d, d),
                  "blk.0.attn_k.weight": (kv * d_head, d), "blk.0.attn_v.weight": (kv * d_head, d),
                  "blk.0.attn_output.weight": (d, d), "blk.0.ffn_gate.weight": (d_mlp, d),
                  "blk.0.ffn_up.weight": (d_mlp, d), "blk.0.ffn_down.weight": (d, d_mlp)}
        for name, shape in shapes.items():
            q = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
            writer.add_tensor(name, np.ones(d, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


#: Small GGUF files of the other registry architectures: the keys each reads and the parts it adds
#: (Qwen2's biases, Phi-3's stacked tensors and long/short rotary factors, Gemma 3's QK-norm, post-norms,
#: window pattern and local rotary base).
FAMILY_SEEDS = {
    "qwen2": dict(parts=dict(attn_bias=True), keys={}),
    "phi3": dict(parts={}, keys={"rope.scaling.original_context_length": 8}, rope_factors=True),
    "gemma3": dict(parts=dict(qk_norm=True, post_norms=True, mlp="geglu"),
                   keys={"attention.sliding_window": 4, "rope.freq_base_swa": 10000.0, "attention.key_length": 16,
                         "attention.value_length": 16, "final_logit_softcapping": 30.0}),
}


def family_gguf(path: Path, arch: str) -> bytes:
    """A two-block model of GGUF architecture `arch` (d = 32, 2 heads of 16, 1 key/value head, V = 8),
    matrices in Q8_0, named as the family registry names them."""
    import torch

    from hybridlm.lm.config import ModelConfig
    from hybridlm.lm.model import DecoderLM
    from hybridlm.weights.families import FAMILIES, GLOBAL

    family, seed = FAMILIES[arch], FAMILY_SEEDS[arch]
    parts = dict(norm="rmsnorm", positions="rotary", mlp="swiglu", attn_bias=False, attn_out_bias=False,
                 mlp_bias=False)
    cfg = ModelConfig(family=arch, vocab_size=8, n_ctx=16, d_model=32, n_layer=2, n_head=2, n_kv_head=1, d_mlp=32,
                      head_dim=16, **{**parts, **seed["parts"]})
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in DecoderLM(cfg).state_dict().items()}
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {"context_length": 16, "embedding_length": 32, "block_count": 2, "feed_forward_length": 32,
                       "attention.head_count": 2, "attention.head_count_kv": 1, "vocab_size": 8,
                       **seed["keys"]}.items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6)
    for ours, shape in shapes.items():
        if ours in GLOBAL:
            names = [GLOBAL[ours][0]]
        else:
            _, layer, rest = ours.split(".", 2)
            path_, _, suffix = rest.rpartition(".")
            names = [f"blk.{layer}.{stem}.{suffix}" for stem in family.block[path_][0]]
        rows = [shape[0] // len(names)] * len(names)
        if len(names) == 3:  # W_Q, W_K, W_V
            rows = [cfg.n_head * 16, 16, 16]
        for name, n in zip(names, rows):
            if len(shape) == 1:
                writer.add_tensor(name, rng.standard_normal(n).astype(np.float32))
            else:
                data = gguf.quants.quantize(rng.standard_normal((n, shape[1])).astype(np.float32),
                                            gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    if seed.get("rope_factors"):
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            writer.add_tensor(name, (1 + rng.random(8)).astype(np.float32))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab", "c", "<|im_start|>", "<|im_end|>", "d", "e"])
    writer.add_token_types([1, 1, 1, 1, 3, 3, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def family_hub_seed(tmp: Path, name: str) -> bytes:
    """A two-block Qwen3 or Gemma 3 folder written by transformers (d = 8), as the harness's one input."""
    import transformers as T

    config_class, model_class, extra = {
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=4)),
        "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(head_dim=4, sliding_window=4)),
    }[name]
    config = config_class(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8, **extra)
    model_class(config).save_pretrained(tmp / name)
    config = (tmp / name / "config.json").read_bytes()
    return struct.pack("<I", len(config)) + config + (tmp / name / "model.safetensors").read_bytes()


def hub_seed(tmp: Path) -> bytes:
    """A one-block GPT-2 (d = 8, 2 heads, V = 16, T = 8) in the hub layout, as the harness's one input."""
    from hybridlm.lm.config import ModelConfig
    from hybridlm.weights.hub import save_hub_folder
    from hybridlm.weights.loading import random_model

    cfg = ModelConfig(vocab_size=16, n_ctx=8, d_model=8, n_layer=1, n_head=2, eos_token_id=0)
    save_hub_folder(random_model(cfg), tmp / "hub")
    config = (tmp / "hub" / "config.json").read_bytes()
    return struct.pack("<I", len(config)) + config + (tmp / "hub" / "model.safetensors").read_bytes()


def trace_seed() -> bytes:
    base = {"k": 0}
    events = [
        {"event": "start", "t": 0, "wall_s": 0.0, "task": "What is 6 * 7?", "model": "scripted",
         "kernel": {"temperature": 1.0, "top_k": None, "top_p": None, "greedy": True},
         "limits": {"max_token_steps": 160, "max_jumps": 3, "max_jumps_per_step": 1}, "tool_choice": "auto",
         "constrain": True, "seed": 0, "control": [],
         "tools": [{"name": "calculator", "description": "Evaluate.", "parameters": {
             "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}]},
        {"event": "phase", "t": 0, "wall_s": 0.01, "phase": "prefill", "mode": "q_G", "tokens": 40},
        {"event": "token", "t": 1, "wall_s": 0.02, "token": 27, "text": "<", "phase": "decode"},
        {"event": "token", "t": 2, "wall_s": 0.025, "token": 28},  # the text is optional
        {"event": "control", "t": 2, "wall_s": 0.03, "controller": "ban", "removed_mass": 0.25,
         "no_safe_token": False},
        {"event": "jump", "t": 2, "wall_s": 0.05, "tool": "calculator", "arguments": {"expression": "6 * 7"},
         "observation": "42", "error": None, "duration_s": 0.002},
        {"event": "batch", "t": 2, "wall_s": 0.06, "row": 0, "action": "join"},
        {"event": "context", "t": 3, "wall_s": 0.07, "kept": 12},
        {"event": "end", "t": 3, "wall_s": 0.08, "answer": "42", "stop_reason": "answer", "token_steps": 3,
         "jumps": 1, "wall_generate_s": 0.07, "wall_external_s": 0.002},
    ]
    return b"".join(json.dumps({**base, **e} if "k" not in e else e).encode() + b"\n" for e in events)


def server_seeds() -> list[bytes]:
    """Request bodies of the OpenAI API: chat with tools and a tool round trip, structured output, completions."""
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}}
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.5,
         "stream": True, "stream_options": {"include_usage": True}, "stop": ["\n"], "seed": 3},
        {"model": "m", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
         "tools": [weather], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
         "parallel_tool_calls": False, "logprobs": True, "top_logprobs": 2, "n": 2},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "JSON please"}]}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
             "type": "object", "properties": {"a": {"type": "integer"}}}}}},
        {"model": "m", "prompt": ["a", "b"], "max_tokens": 4, "logprobs": 1, "echo": True},
        {"model": "m", "prompt": [1, 2, 3], "suffix": None, "best_of": 1},
    ]
    return [json.dumps(b).encode() for b in bodies]


def vocab_seeds() -> list[bytes]:
    """FuzzedDataProvider inputs for gguf_vocab: any bytes are metadata; a few fixed patterns start the search."""
    rng = np.random.default_rng(0)
    return [bytes(range(256)) * 4, bytes(rng.integers(0, 256, 1500, dtype=np.uint8)),
            bytes(rng.integers(0, 8, 1500, dtype=np.uint8)), b"\x01" * 700 + b"llama" * 50]


def folder_seeds() -> list[bytes]:
    """Inputs of tokenizer_folder: a byte-level BPE tokenizer.json with its config files, and a SentencePiece
    tokenizer.model with added tokens (files picked by the first byte, each a u16 length and its bytes)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from hybridlm.weights.vocab import tokenizer_from_metadata

    tokens = ["a", "b", "ab", "Ġ", "Ġa", "<|im_start|>", "<|im_end|>", "c", "<tool>"]
    tok = tokenizer_from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3, 3, 1, 4], "tokenizer.ggml.merges": ["a b", "Ġ a"]}, name="s")
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": False,
              "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"}
    proto = pb.ModelProto()
    for piece, kind in [("<unk>", 2), ("<s>", 3), ("</s>", 3), *((f"<0x{b:02X}>", 6) for b in range(256)),
                        ("\u2581", 1), ("a", 1), ("b", 1), ("\u2581a", 1), ("ab", 1), ("<x>", 4)]:
        proto.pieces.add(piece=piece, score=-len(proto.pieces), type=kind)
    proto.trainer_spec.model_type, proto.trainer_spec.unk_id = pb.TrainerSpec.BPE, 0
    proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 1, 2
    norm = proto.normalizer_spec
    norm.add_dummy_prefix, norm.escape_whitespaces, norm.remove_extra_whitespaces = True, True, False
    added = {"added_tokens_decoder": {"265": {"content": "<end>", "special": True}}}

    def folder(files: dict[int, bytes], text: str) -> bytes:  # file index (fuzz/tokenizer_folder.py's FILES) → bytes
        out = bytes([sum(1 << i for i in files)])
        for i in sorted(files):
            out += struct.pack("<H", len(files[i])) + files[i]
        return out + text.encode()

    return [
        folder({0: tok.backend.to_str().encode(), 2: json.dumps(config).encode(),
                4: b'{"eos_token_id": [6, 5]}'}, "ab <|im_end|> a"),
        folder({0: tok.backend.to_str().encode(), 3: b'{"bos_token": "a"}', 5: b"{{ messages }}"}, "b<tool>a"),
        folder({1: proto.SerializeToString(), 2: json.dumps(added).encode()}, "ab a <end><s>"),
    ]


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write("gguf_reader", "tiny_llama.gguf", tiny_gguf(tmp / "a.gguf", tensors=True))
        write("gguf_reader", "metadata_only.gguf", tiny_gguf(tmp / "b.gguf", tensors=False))
        write("hub_reader", "tiny_gpt2.bin", hub_seed(tmp))
        for arch in FAMILY_SEEDS:
            write("gguf_reader", f"tiny_{arch}.gguf", family_gguf(tmp / f"{arch}.gguf", arch))
        for name in ("qwen3", "gemma3"):
            write("hub_reader", f"tiny_{name}.bin", family_hub_seed(tmp, name))
    write("trace_reader", "arc.jsonl", trace_seed())
    for i, seed in enumerate(vocab_seeds()):
        write("gguf_vocab", f"metadata{i}.bin", seed)
    for i, seed in enumerate(folder_seeds()):
        write("tokenizer_folder", f"folder{i}.bin", seed)
    for i, body in enumerate(server_seeds()):
        write("server_request", f"body{i}.json", body)
    for i, expression in enumerate(["123456 * 789", "(2 + 3) * 4 ** 2 / 8", "7 // 2 + 7 % 2", "sqrt(144) + abs(-3)",
                                    "2 ** 0.5", "-(3 - 10) ** 3", "1,000 × 3 ÷ 4", "round(2.675)"]):
        write("calculator", f"expr{i}.txt", expression.encode())
    for i, kb in enumerate([{"Boiling point of water": "100 °C", "pi": 3.14159},
                            {"nothing": None, "list": [1, [2, [3]]], "obj": {"a": {"b": True}}}]):
        write("knowledge_base", f"kb{i}.json", json.dumps(kb, ensure_ascii=False).encode())
    # FuzzedDataProvider reads a length, then text, then token choices: any bytes are an input;
    # these start the search near real turns
    for i, turn in enumerate(['<tool_call>{"name": "f", "arguments": {"n": -3, "xs": [1.5, 2]}}</tool_call>',
                              '<tool_call>{"name": "g", "arguments": {"e": "上海"}}</tool_call> done',
                              'The answer is 4.', '<tool_call>{"name": "f", "arguments": {"n": [[[[]]]]}']):
        write("call_parser", f"turn{i}.txt", bytes([200, 0]) + turn.encode())


if __name__ == "__main__":
    main()
