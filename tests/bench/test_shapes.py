"""bench/shapes.py: a shape saved with random weights is a folder the engine loads."""

import torch
from safetensors.torch import load_file

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.bench import shapes


def test_a_saved_shape_loads_with_its_weights(monkeypatch, tmp_path, smollm2):
    tiny = dict(shapes.QWEN_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    monkeypatch.setitem(shapes.SHAPES, "tiny", tiny)
    monkeypatch.setattr(shapes.loader, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setenv("TOKENDANCE_TOKENIZER", str(smollm2))
    folder = shapes.save_random("tiny", tmp_path / "tiny")
    assert (folder / "tokenizer.json").exists() and (folder / "chat_template.jinja").exists()
    eng = Engine(model=str(folder), dtype="float32")
    assert (eng.mcfg.hidden_size, eng.mcfg.num_layers, eng.mcfg.vocab_size) == (64, 2, 152064)
    saved = load_file(folder / "model.safetensors")["model.embed_tokens.weight"].float()
    assert torch.equal(eng.model.model.embed_tokens.weight, saved)  # its weights, not fresh random ones
    [(ids, _, finish)] = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    assert len(ids) == 2 and finish == "length"
    own = shapes.save_random("tiny", tmp_path / "own", vocab=True)
    mine = Engine(model=str(own), dtype="float32")
    assert mine.mcfg.vocab_size == len(eng.tokenizer) == 49152 and mine.eos == {eng.tokenizer.eos_token_id}
