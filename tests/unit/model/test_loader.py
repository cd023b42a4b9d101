import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg.worker.forward_context import ForwardContext, set_forward_context
from disagg.worker.model import load_model, write_tiny_checkpoint


def _edit_weights(path, edit):
    file = path / "model.safetensors"
    weights = load_file(file)
    edit(weights)
    save_file(weights, file, metadata={"format": "pt"})


def _logits(model, ids):
    with set_forward_context(ForwardContext(attn_metadata=None, kv_cache=None)):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def test_loads_every_tensor_and_is_ready_for_inference(tiny_model_dir):
    model, config = load_model(tiny_model_dir)
    params = dict(model.named_parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params.values())
    assert not any(p.requires_grad for p in params.values())
    assert not model.training
    assert _logits(model, [1, 2, 3]).shape == (3, config.vocab_size)


def test_missing_tensor_names_tensor_and_directory(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    _edit_weights(path, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=rf"missing.*{tmp_path}.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_unexpected_tensor_is_rejected_but_rotary_inv_freq_is_ignored(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    _edit_weights(path, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(path)
    _edit_weights(path, lambda w: w.update({"model.layers.0.extra.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.extra\.weight"):
        load_model(path)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    _edit_weights(path, lambda w: w.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(65,\).*\(64,\)"):
        load_model(path)


def test_missing_config_or_weights_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(path)


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, tiny_model_dir):
    sharded = write_tiny_checkpoint(tmp_path / "sharded", sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) == 2
    a, _ = load_model(sharded)
    b, _ = load_model(tiny_model_dir)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_tied_embeddings_share_one_matrix(tmp_path):
    model, config = load_model(write_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True))
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bfloat16_loads_and_runs_close_to_float32(tiny_model_dir):
    model16, _ = load_model(tiny_model_dir, dtype="bfloat16")
    model32, _ = load_model(tiny_model_dir)
    assert model16.model.embed_tokens.weight.dtype == torch.bfloat16
    got, want = _logits(model16, [0, 40, 41, 42]), _logits(model32, [0, 40, 41, 42])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_through_the_paged_cache(tiny_model_dir, paged_kv, dtype):
    model, config = load_model(tiny_model_dir, dtype=dtype)
    kv = paged_kv(config, dtype=getattr(torch, dtype))
    ids = [0, 40, 41, 42, 43, 44]
    (full,) = kv.step(model, [("a", ids)])
    kv.step(model, [("b", ids[:4])])
    _, rest = kv.step(model, [("a", [7]), ("b", ids[4:])])  # decode + prefill over a cached prefix
    assert kv.kv_cache.dtype == getattr(torch, dtype) and torch.isfinite(full).all()
    torch.testing.assert_close(rest, full[4:], atol=0.05, rtol=0)


def test_auto_dtype_follows_the_checkpoint(tmp_path):
    model, _ = load_model(write_tiny_checkpoint(tmp_path / "f16", dtype="float16"), dtype="auto")
    assert model.model.norm.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="float64"):
        load_model(tmp_path / "f16", dtype="float64")
