"""Tier 1: checkpoint loaders on synthetic GGUF files and HF folders (the real default model:
tests/model/test_loader_default_model.py)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kvserve.errors import ModelLoadError
from kvserve.loader import Checkpoint, load_checkpoint
from kvserve.loader.gguf_loader import unpermute_rotary_rows

# A tiny model whose rows (ggml ne[0] = 256) fit every quant block size, K-quants included.
TINY = dict(vocab=32, hidden=256, inter=256, layers=2, heads=4, kv_heads=2, head_dim=64)

_BLOCK_PARTS = {  # HF suffix -> GGUF part (test-side copy, independent of the loader)
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK_PARTS[part]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tiny_hf_tensors(rng: np.random.Generator, bias: bool, tied: bool) -> dict[str, np.ndarray]:
    """Random float32 tensors of the TINY model, HF names and layout."""
    h, v, i = TINY["hidden"], TINY["vocab"], TINY["inter"]
    q_rows, kv_rows = TINY["heads"] * TINY["head_dim"], TINY["kv_heads"] * TINY["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(TINY["layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_rows, h), p + "self_attn.k_proj.weight": (kv_rows, h),
            p + "self_attn.v_proj.weight": (kv_rows, h), p + "self_attn.o_proj.weight": (h, q_rows),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i)})
        if bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_rows,),
                           p + "self_attn.k_proj.bias": (kv_rows,),
                           p + "self_attn.v_proj.bias": (kv_rows,)})
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _write_tiny_gguf(path, arch: str, file_tensors: dict[str, tuple[np.ndarray, QT | None]],
                     with_vocab_size: bool = True) -> None:
    """Write a TINY GGUF; ``file_tensors``: GGUF name -> (array as stored, raw qtype or None)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", TINY["layers"])
    writer.add_uint32(f"{arch}.context_length", 512)
    writer.add_uint32(f"{arch}.embedding_length", TINY["hidden"])
    writer.add_uint32(f"{arch}.feed_forward_length", TINY["inter"])
    writer.add_uint32(f"{arch}.attention.head_count", TINY["heads"])
    writer.add_uint32(f"{arch}.attention.head_count_kv", TINY["kv_heads"])
    writer.add_uint32(f"{arch}.rope.dimension_count", TINY["head_dim"])
    writer.add_float32(f"{arch}.rope.freq_base", 500000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if with_vocab_size:
        writer.add_uint32(f"{arch}.vocab_size", TINY["vocab"])
    writer.add_token_list([f"t{i}" for i in range(TINY["vocab"])])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 3)
    for name, (array, qtype) in file_tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------- 1. dequantisation

# Quantisable types: max abs error allowed, as a fraction of the tensor's max |x|.
_QUANTISE_TOL = {QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 4e-3, QT.Q8_0: 0.005,
                 QT.Q5_0: 0.07, QT.Q5_1: 0.04, QT.Q4_0: 0.13, QT.Q4_1: 0.07}
# Types gguf may only dequantise: byte ranges of each block's float16 scales,
# overwritten with finite values so random blocks decode without inf/nan.
_RAW_F16_SPANS = {QT.Q2_K: (80, 84), QT.Q3_K: (108, 110), QT.Q4_K: (0, 4),
                  QT.Q5_K: (0, 4), QT.Q6_K: (208, 210), QT.IQ4_NL: (0, 2)}


def _can_quantise(qtype: QT) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def _random_blocks(rng: np.random.Generator, shape: tuple[int, int], qtype: QT) -> np.ndarray:
    """Random raw bytes of a [rows, cols] tensor of ``qtype``, scales kept finite."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    start, stop = _RAW_F16_SPANS[qtype]
    scales = rng.uniform(-0.1, 0.1, size=(blocks.shape[0], (stop - start) // 2)).astype(np.float16)
    blocks[:, start:stop] = scales.view(np.uint8)
    return blocks.reshape(rows, cols // block_size * type_size)


@pytest.mark.parametrize("qtype", list(_QUANTISE_TOL) + list(_RAW_F16_SPANS),
                         ids=lambda t: t.name)
def test_dequantise_each_type(tmp_path, qtype):
    """Every 2-D weight stored as ``qtype`` (qwen2: no q/k permutation to undo)."""
    rng = np.random.default_rng(int(qtype))
    originals = _tiny_hf_tensors(rng, bias=True, tied=False)
    quantisable = qtype in _QUANTISE_TOL
    if quantisable and not _can_quantise(qtype):
        pytest.skip(f"installed gguf cannot quantise {qtype.name}")
    file_tensors, expected = {}, {}
    for name, x in originals.items():
        if x.ndim == 1:
            file_tensors[_gguf_name(name)] = (x, None)
            expected[name] = x
            continue
        stored = gguf.quants.quantize(x, qtype) if quantisable else _random_blocks(rng, x.shape, qtype)
        raw = None if stored.dtype != np.uint8 else qtype
        file_tensors[_gguf_name(name)] = (stored, raw)
        expected[name] = gguf.quants.dequantize(stored, qtype).reshape(x.shape)
    _write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", file_tensors)

    ckpt = load_checkpoint(str(tmp_path / "tiny.gguf"))
    assert set(ckpt.tensors) == set(originals)
    for name, x in originals.items():
        got = ckpt.tensors[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == x.shape, name
        assert torch.equal(got, torch.from_numpy(np.asarray(expected[name], np.float32))), name
        if quantisable:
            tol = _QUANTISE_TOL[qtype] * float(np.abs(x).max())
            assert float(np.abs(got.numpy() - x).max()) <= tol, (name, qtype.name)
        assert np.isfinite(got.numpy()).all(), name


# ---------------------------------------------------------------- 2. llama q/k permutation

def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, rows, rest in [(4, 256, (8,)), (2, 128, (3,)), (3, 192, ())]:
        w = rng.standard_normal((rows, *rest)).astype(np.float32)
        assert np.array_equal(unpermute_rotary_rows(_llama_cpp_permute(w, n_head), n_head), w)


@pytest.mark.parametrize("llama_bias", [False, True])
def test_tiny_llama_gguf_round_trip(tmp_path, llama_bias):
    rng = np.random.default_rng(1)
    originals = _tiny_hf_tensors(rng, bias=llama_bias, tied=True)
    file_tensors = {}
    for name, x in originals.items():
        if ".q_proj." in name:
            x = _llama_cpp_permute(x, TINY["heads"])
        elif ".k_proj." in name:
            x = _llama_cpp_permute(x, TINY["kv_heads"])
        file_tensors[_gguf_name(name)] = (x, None)
    _write_tiny_gguf(tmp_path / "llama.gguf", "llama", file_tensors, with_vocab_size=False)

    ckpt = load_checkpoint(str(tmp_path / "llama.gguf"))
    assert ckpt.kind == "gguf"
    assert set(ckpt.tensors) == set(originals)
    for name, x in originals.items():
        assert torch.equal(ckpt.tensors[name], torch.from_numpy(x)), name
    cfg = ckpt.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "llama", TINY["vocab"], TINY["hidden"], TINY["inter"])
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 64)
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 512
    assert cfg.tie_word_embeddings and cfg.attention_bias == llama_bias
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 3)


def test_tiny_qwen2_gguf_keeps_qk_unpermuted(tmp_path):
    rng = np.random.default_rng(2)
    originals = _tiny_hf_tensors(rng, bias=True, tied=False)
    _write_tiny_gguf(tmp_path / "qwen2.gguf", "qwen2",
                     {_gguf_name(n): (x, None) for n, x in originals.items()})
    ckpt = load_checkpoint(str(tmp_path / "qwen2.gguf"))
    assert ckpt.config.architecture == "qwen2" and ckpt.config.attention_bias
    assert not ckpt.config.tie_word_embeddings
    for name, x in originals.items():
        assert torch.equal(ckpt.tensors[name], torch.from_numpy(x)), name


# ---------------------------------------------------------------- 3. Hugging Face folders

def _tiny_transformers_model(kind: str, tied: bool):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=20000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                  bos_token_id=1, eos_token_id=[2, 5])
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))


@pytest.mark.parametrize("kind,tied,shard", [("llama", False, False), ("llama", False, True),
                                             ("qwen2", True, False)])
def test_hf_folder_round_trip(tmp_path, kind, tied, shard):
    model = _tiny_transformers_model(kind, tied)
    with torch.no_grad():  # random, non-trivial norms and biases
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_()
    extra = {"max_shard_size": "40KB"} if shard else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **extra)
    assert shard == (tmp_path / "model.safetensors.index.json").exists()

    ckpt = load_checkpoint(str(tmp_path))
    reference = model.state_dict()
    expected_names = set(reference) - ({"lm_head.weight"} if tied else set())
    assert ckpt.kind == "hf" and set(ckpt.tensors) == expected_names
    for name in expected_names:
        assert ckpt.tensors[name].dtype == torch.float32
        assert torch.equal(ckpt.tensors[name], reference[name]), name
    cfg = ckpt.config
    assert cfg.architecture == kind and cfg.attention_bias == (kind == "qwen2")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (96, 64, 128, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (20000.0, 1e-5, 256)
    assert cfg.tie_word_embeddings == tied and cfg.rope_scaling is None
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 5)


def test_hf_folder_bf16_is_converted_to_float32(tmp_path):
    model = _tiny_transformers_model("llama", tied=False).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = load_checkpoint(str(tmp_path))
    for name, tensor in model.state_dict().items():
        assert ckpt.tensors[name].dtype == torch.float32
        assert torch.equal(ckpt.tensors[name], tensor.float()), name


# ---------------------------------------------------------------- 4. paths and errors


def test_missing_path_raises(tmp_path):
    for missing in (tmp_path / "nope", tmp_path / "nope.gguf"):
        with pytest.raises(ModelLoadError):
            load_checkpoint(str(missing))


def test_folder_without_config_json_raises(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_checkpoint(str(tmp_path))


def test_unsupported_file_kind_raises(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError):
        load_checkpoint(str(tmp_path / "weights.bin"))


def test_gguf_with_truncated_tensor_data_raises(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {_gguf_name(n): (x, None) for n, x in _tiny_hf_tensors(rng, True, False).items()}
    _write_tiny_gguf(tmp_path / "whole.gguf", "qwen2", tensors)
    data = (tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 3 // 4])
    with pytest.raises(ModelLoadError):
        load_checkpoint(str(tmp_path / "cut.gguf"))


def test_random_bytes_gguf_raises(tmp_path):
    (tmp_path / "noise.gguf").write_bytes(np.random.default_rng(4).bytes(4096))
    with pytest.raises(ModelLoadError):
        load_checkpoint(str(tmp_path / "noise.gguf"))


def test_unsupported_gguf_architecture_raises(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_checkpoint(str(tmp_path / "gpt2.gguf"))


def test_hf_folder_with_wrong_shapes_raises(tmp_path):
    model = _tiny_transformers_model("llama", tied=False)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config = (tmp_path / "config.json").read_text().replace('"intermediate_size": 128',
                                                            '"intermediate_size": 96')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match="shape"):
        load_checkpoint(str(tmp_path))


def test_checkpoint_is_a_dataclass_with_the_agreed_fields():
    assert set(Checkpoint.__dataclass_fields__) == {"config", "tensors", "path", "kind"}
