"""The cache protocol of a served model: every path that makes a cache makes a LatentCache, any other cache
is refused, the state dict keeps the original names, and save_pretrained round-trips both ways."""

import pytest
import torch
from safetensors import safe_open

import stiefkv
from stiefkv.cache import LatentCache
from stiefkv.projections import PROJECTIONS_FILE
from tests.tiny import random_projections, tiny_model, tiny_tokenizer
from tests.utils import assert_close


def ids(batch=2, n=7, seed=0):
    return torch.randint(2, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


class CacheSeen:
    """Records the type of the cache each forward of layer 0's attention receives."""

    def __init__(self, model):
        self.types = []
        attn = model.model.layers[0].self_attn
        self.handle = attn.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.types.append(type(cache).__name__)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def served(arch="llama", rk=16, rv=12, key_mode="pre_rope"):
    model = tiny_model(arch)
    stiefkv.load(model, random_projections(model, rk, rv, key_mode))
    return model


GREEDY = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
NO_END = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("use_cache", [True, None])  # explicit, and the config's default
def test_plain_forward_with_use_cache_makes_a_latent_cache(use_cache):
    model = served()
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    out = model(ids(n=9), **kwargs)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, LatentCache)
    assert cache.layers[0].keys.shape == (2, 2, 9, 16) and cache.positions.shape == (2, 9)
    assert cache.nbytes == 2 * 2 * 9 * 2 * (16 + 12) * 4 + 2 * 9 * 4  # L·B·N·G·(r_k + r_v)·fp32 + positions
    # and it continues correctly
    nxt = model(ids(n=3, seed=1), **{stiefkv.attention.cache_keyword(model): cache})
    full = model(torch.cat([ids(n=9), ids(n=3, seed=1)], 1), use_cache=False)
    assert_close(nxt.logits, full.logits[:, 9:], atol=2e-5, rtol=1e-4, what="continued from the made cache")


def test_use_cache_false_makes_no_cache():
    model = served()
    with CacheSeen(model) as seen:
        out = model(ids(), use_cache=False)
    assert seen.types == ["NoneType"]
    assert getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None


@pytest.mark.parametrize("make", ["DynamicCache", "DynamicCache-filled"])
def test_a_foreign_cache_is_refused_clearly(make):
    from transformers import DynamicCache

    model = served()
    cache = DynamicCache()
    if make.endswith("filled"):
        cache.update(torch.zeros(2, 2, 3, 24), torch.zeros(2, 2, 3, 24), 0)
    with pytest.raises(ValueError, match="LatentCache.*got a DynamicCache"):
        model(ids(), past_key_values=cache)
    # generate leaves a cache the user passes alone (it used to swap an empty one for a LatentCache the user
    # never saw): the forward refuses it with the same message
    with pytest.raises(ValueError, match="LatentCache.*got a DynamicCache"):
        model.generate(ids(n=4), past_key_values=cache, **GREEDY)
    mine = LatentCache()
    model.generate(ids(n=4), past_key_values=mine, **GREEDY)
    assert mine.get_seq_length() > 4  # the user's own LatentCache is the one filled


def test_a_latent_cache_continues_only_the_batch_it_holds():
    model = served()
    cache = LatentCache()
    model(ids(batch=2), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="holds 2 rows and the forward brings 3"):
        model(ids(batch=3), past_key_values=cache, use_cache=True)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.positions is None
    model(ids(batch=3), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 7


def test_a_cache_filled_under_other_bases_of_the_same_ranks_is_refused():
    """The model served again with another checkpoint of the same ranks: its latents would be read as the new
    bases' silently. Refused at the next forward and by compact; a deep copy of the model (the same bases)
    continues the cache, and a reset cache takes the new bases."""
    import copy

    model = served()
    cache = LatentCache()
    with torch.no_grad():
        model(ids(), past_key_values=cache, use_cache=True)
    twin = copy.deepcopy(model)
    twin(ids(n=2, seed=1), past_key_values=copy.deepcopy(cache), use_cache=True)
    stiefkv.load(model, random_projections(model, 16, 12, seed=5))
    with pytest.raises(ValueError, match="layer 0 of this cache holds latents of other bases"):
        model(ids(n=2, seed=1), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="layer 0 holds latents of other bases of the same ranks"):
        stiefkv.compact(model, cache, keep=0.5)
    cache.reset()
    model(ids(), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 7


def test_generate_goes_through_the_wrapped_cache_preparation():
    """The one instance wrapper load installs: it fails here, not silently, if transformers stops preparing
    generate's cache in ``_prepare_cache_for_generation``."""
    from transformers import GenerationMixin

    assert hasattr(GenerationMixin, "_prepare_cache_for_generation")
    model = served()
    assert "_prepare_cache_for_generation" in model.__dict__
    with CacheSeen(model) as seen:
        model.generate(ids(n=4), **GREEDY)
    assert set(seen.types) == {"LatentCache"}
    stiefkv.unload(model)
    assert "_prepare_cache_for_generation" not in model.__dict__


def test_beam_search_uses_and_reorders_the_latent_cache():
    model = served(key_mode="pre_rope")
    x = ids(batch=2, n=5)
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=5, min_new_tokens=5, do_sample=False,
              pad_token_id=0, attention_mask=torch.ones_like(x))
    with CacheSeen(model) as seen:
        cached = model.generate(x, use_cache=True, **kw)
    assert set(seen.types) == {"LatentCache"}
    assert torch.equal(cached, model.generate(x, use_cache=False, **kw))


def test_assisted_decoding_equals_greedy():
    model = served()
    assistant = tiny_model("llama")  # uncompressed, same vocabulary
    x = ids(batch=1, n=6)
    mask = torch.ones_like(x)
    # six tokens by dropping the end token: transformers 5.0 refuses min_new_tokens beside an assistant
    greedy = model.generate(x, attention_mask=mask, **NO_END)
    with CacheSeen(model) as seen:
        assisted = model.generate(x, attention_mask=mask, assistant_model=assistant, **NO_END)
    assert set(seen.types) == {"LatentCache"}
    assert assisted.shape[1] == x.shape[1] + 6 and torch.equal(assisted, greedy)


def test_prompt_lookup_decoding_equals_greedy():
    model = served()
    x = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    mask = torch.ones_like(x)
    greedy = model.generate(x, attention_mask=mask, **GREEDY)
    with CacheSeen(model) as seen:
        looked_up = model.generate(x, attention_mask=mask, prompt_lookup_num_tokens=3, **GREEDY)
    assert set(seen.types) == {"LatentCache"}
    assert torch.equal(looked_up, greedy)


def test_pipeline_uses_the_latent_cache():
    from transformers import pipeline

    model = served()
    tok = tiny_tokenizer()
    generator = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    with CacheSeen(model) as seen:
        out = generator("t5 t6 t7", max_new_tokens=4, do_sample=False, return_full_text=False)
    text = out[0]["generated_text"]
    assert set(seen.types) == {"LatentCache"}
    prompt = tok("t5 t6 t7", return_tensors="pt")
    expected = model.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=4,
                              do_sample=False, pad_token_id=0)[0, 3:]
    assert text.split() == tok.convert_ids_to_tokens(expected.tolist())


def test_state_dict_keeps_the_original_names():
    model = tiny_model("qwen3")  # a key norm and a query norm besides the projections
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stiefkv.load(model, random_projections(model, 8, 16))
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_save_pretrained_round_trips_both_ways(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(arch)
    x = ids(n=8)
    original = model(x).logits
    proj = random_projections(model, 8, 16)
    stiefkv.load(model, proj)
    compressed = model(x).logits
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / PROJECTIONS_FILE).is_file()
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.k_proj.weight" in names and not any("original" in n for n in names)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not stiefkv.attention.is_compressed(plain)
    assert torch.equal(plain(x).logits, original)
    reloaded, _ = stiefkv.load_model(str(tmp_path))
    assert stiefkv.attention.is_compressed(reloaded)
    assert_close(reloaded(x).logits, compressed, atol=1e-6, rtol=1e-6, what="reloaded compressed model")
    # unloaded, save_pretrained is transformers' own again and writes no bases
    stiefkv.unload(model)
    model.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / PROJECTIONS_FILE).exists()


HUB_SCRIPT = """
import sys, torch, stiefkv
from stiefkv.models import ModelLoadError
x = torch.load(sys.argv[1])
model, _ = stiefkv.load_model("me/tiny-served")
plain, _ = stiefkv.load_model("me/tiny-served", projections=False)
try:
    stiefkv.load_model("me/tiny-no-bases")
    refused = ""
except ModelLoadError as exc:
    refused = str(exc)
from stiefkv.models import served_bases
found = [str(served_bases("me/tiny-served")), served_bases("me/not-in-the-cache")]  # what eval reads
torch.save(dict(served=stiefkv.attention.is_compressed(model), logits=model(x).logits, found=found,
                plain_served=stiefkv.attention.is_compressed(plain), plain=plain(x).logits, refused=refused),
           sys.argv[2])
"""


def _hub_snapshot(cache, repo, folder, leave_out=()):
    """``folder``'s files as the hub's local cache holds a download of ``repo`` at ``main``."""
    import shutil

    root = cache / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(folder, root / "snapshots" / commit, ignore=shutil.ignore_patterns(*leave_out))


def test_a_served_folder_uploaded_to_the_hub_loads_served(tmp_path):
    """A hub id's folder that names its bases in config.json is served with them (fetched beside the weights,
    here from the hub's local cache offline); named but missing, the load says so; projections=False loads
    the original. Before, a hub id always loaded the original model, silently."""
    import os
    import subprocess
    import sys

    model = tiny_model()
    x = ids(n=8)
    original = model(x).logits
    stiefkv.load(model, random_projections(model, 8, 16))
    compressed = model(x).logits
    model.save_pretrained(tmp_path / "folder")
    tiny_tokenizer().save_pretrained(tmp_path / "folder")
    _hub_snapshot(tmp_path / "hub", "me/tiny-served", tmp_path / "folder")
    _hub_snapshot(tmp_path / "hub", "me/tiny-no-bases", tmp_path / "folder", leave_out=[PROJECTIONS_FILE])
    torch.save(x, tmp_path / "x.pt")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", HUB_SCRIPT, str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["served"] and not out["plain_served"]
    assert_close(out["logits"], compressed, atol=1e-6, rtol=1e-6, what="the hub id, served")
    assert_close(out["plain"], original, atol=1e-6, rtol=1e-6, what="the hub id, projections=False")
    assert "me/tiny-no-bases" in out["refused"] and PROJECTIONS_FILE in out["refused"]
    assert "projections=False" in out["refused"]
    assert out["found"][0].endswith(PROJECTIONS_FILE) and out["found"][1] is None


@pytest.mark.parametrize("implementation", ["offloaded", "offloaded_static"])
def test_offloaded_caches_are_refused(implementation):
    """generate's offloaded caches were replaced by a latent cache on the device without a word: refused,
    naming what works."""
    model = tiny_model()
    stiefkv.load(model, random_projections(model, 11, 13))
    with pytest.raises(ValueError, match="'offloaded'.*not supported.*ask for 'static'"):
        model.generate(ids(n=6), max_new_tokens=2, cache_implementation=implementation, pad_token_id=0)


def test_a_model_served_from_inside_inference_mode_runs_outside_it_too(caplog):
    """stiefkv.load inside torch.inference_mode() made the bases, their masters and casts and the folds
    inference tensors: every forward then failed inside torch (no version counter), and any backward
    afterwards (they cannot be saved for it). They are ordinary tensors now, whatever the mode; the same
    logits as a model served outside it."""
    model, want = tiny_model(), tiny_model()
    x = ids(n=6)
    stiefkv.load(want, random_projections(want, 11, 13))
    with torch.inference_mode():
        stiefkv.load(model, random_projections(model, 11, 13))
        inside = model(x).logits
        model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model(x).logits, inside) and torch.equal(want(x).logits, inside)
    model(x).logits.sum().backward()  # gradients reach the embeddings, not the folded k/v/o weights
    assert model.model.embed_tokens.weight.grad is not None
    assert "inference tensors" not in caplog.text
    with torch.inference_mode():  # weights made there have no version: edits to them cannot be seen
        made_inside = tiny_model()
    stiefkv.load(made_inside, random_projections(made_inside, 11, 13))
    assert "inference tensors" in caplog.text and "call stiefkv.load again" in caplog.text


def test_a_served_model_saved_under_the_home_folder_keeps_one_folder(tmp_path, monkeypatch):
    """save_pretrained("~/x"): transformers wrote ./~/x and the bases went to $HOME/x."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    model = tiny_model("llama")
    stiefkv.load(model, random_projections(model, 8, 16))
    model.save_pretrained("~/served")
    served = tmp_path / "served"
    assert (served / "config.json").is_file() and (served / PROJECTIONS_FILE).is_file()
    assert not (tmp_path / "~").exists()


def test_unload_and_refused_loads_leave_the_model_as_it_was(tmp_path):
    """unload left the original attention in the mode it had at load (dropout on in eval); a refused load
    or compressed() (a backend typo) unloaded a served model first; save_pretrained(push_to_hub=True)
    uploaded before the bases were written, and a file given as the folder failed inside pathlib."""
    model = tiny_model("llama")
    proj = random_projections(model, 8, 16)
    model.train()
    stiefkv.load(model, proj)
    model.eval()
    stiefkv.unload(model)
    assert not any(m.training for m in model.modules())
    stiefkv.load(model, proj)
    model.train()
    stiefkv.unload(model)
    assert all(m.training for m in model.modules())
    model.eval()
    x = ids(n=8)
    stiefkv.load(model, proj)
    served = model(x).logits
    with pytest.raises(ValueError, match="backend must be one of"):
        stiefkv.load(model, random_projections(model, 16, 8), backend="trition")
    with pytest.raises(ValueError, match="backend must be one of"):
        with stiefkv.compressed(model, random_projections(model, 16, 8), backend="x"):
            pass
    assert stiefkv.attention.is_compressed(model) and torch.equal(model(x).logits, served)
    with pytest.raises(ValueError, match="save_pretrained\\(folder\\) first and upload that folder"):
        model.save_pretrained(tmp_path / "hub", push_to_hub=True, repo_id="me/x")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file: save_pretrained writes a model folder"):
        model.save_pretrained(tmp_path / "file")
    assert not (tmp_path / "hub").exists()


def test_left_padding_lengths_are_cache_fields():
    model = served()
    x = ids(batch=2, n=6)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    cache = LatentCache()
    model(x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache)
    assert cache.lengths.tolist() == [4, 6]
    assert cache.positions.tolist()[0] == [0, 0, 0, 1, 2, 3]
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.lengths.tolist() == [6, 4] and cache.positions.tolist()[1] == [0, 0, 0, 1, 2, 3]
    assert not any(name.startswith("_stiefkv") for name in vars(cache))



def test_a_latent_cache_refuses_an_unserved_model():
    """A served model's returned cache continued by the same model after unload: its attention wrote keys
    and values among the latents (wrong tokens at full rank, a size error inside transformers below it)."""
    ids = torch.randint(3, 90, (1, 12))
    for rank in (24, 8):
        model = tiny_model()
        stiefkv.load(model, random_projections(model, rank, rank))
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
        stiefkv.unload(model)
        with pytest.raises(ValueError, match="holds a served model's latents"):
            model.generate(torch.cat([out.sequences, ids[:, :2]], 1), past_key_values=out.past_key_values,
                           max_new_tokens=2, pad_token_id=0)
