import pytest
import torch

from disagg.worker.model import ModelConfig, Tokenizer, load_model, write_tiny_checkpoint


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=3)
    b = write_tiny_checkpoint(tmp_path / "b", seed=3)
    c = write_tiny_checkpoint(tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_config_matches_tokenizer(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "t")
    config, tok = ModelConfig.from_dir(path), Tokenizer(path)
    assert config.vocab_size == tok.vocab_size
    assert 512 <= tok.vocab_size <= 1000
    assert set(config.eos_token_ids) == tok.eos_token_ids
    assert config.bos_token_id == tok.bos_token_id


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "MistralForCausalLM"])
def test_other_architectures_load(tmp_path, architecture):
    model, config = load_model(write_tiny_checkpoint(tmp_path / "t", architecture=architecture, num_layers=1))
    assert config.architecture == architecture
    assert config.qkv_bias == (architecture == "Qwen2ForCausalLM")


def test_bad_arguments_name_the_value(tmp_path):
    with pytest.raises(ValueError, match="GPT2"):
        write_tiny_checkpoint(tmp_path, architecture="GPT2")
    with pytest.raises(ValueError, match="vocab_size=10"):
        write_tiny_checkpoint(tmp_path, vocab_size=10)


def test_transformers_reads_the_tiny_checkpoint_identically(tmp_path, paged_kv):
    transformers = pytest.importorskip("transformers")
    path = write_tiny_checkpoint(tmp_path / "t", tie_word_embeddings=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    tok = Tokenizer(path)
    text = "Good morning, robot! 🙂"
    assert hf_tok(text)["input_ids"] == tok.encode(text)
    ids = tok.encode(text)
    model, config = load_model(path)
    (logits,) = paged_kv(config).step(model, [("r", ids)])
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(torch.tensor([ids])).logits[0], atol=1e-4, rtol=0)
