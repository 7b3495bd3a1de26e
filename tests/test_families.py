"""Any HF causal LM (issue 38, item 4): the architecture families of models/families.py on tiny random-weight
models built here (no download) of the Llama, Qwen3, GPT-2, GPT-NeoX and Gemma families.

Per family: loading a `save_pretrained` folder by path; the engine's residual record at every depth equals HF's
`output_hidden_states` (depth L before the final norm, HF's last entry after it); recirculation at alpha 0 is the
base model and its blockwise passes >= T equal the exact sequential run; interventions.run (standard and
recirculation), probes.run and analysis.evaluate run on the folder by path; FullBandwidthLM wraps the model and
runs recurrent-full; an unsupported family is refused in one line naming the supported ones. Sliding windows survive
a custom 4-D mask through Family.attention_masks."""
from __future__ import annotations

import json

import pytest
import torch

from common.errors import UserError
from models.families import FAMILIES, family_of

# one type per family end to end, and one mixture of experts
FAMILY_NAMES = ("llama", "qwen3", "gpt2", "gpt_neox", "gemma3_text", "olmo2", "phi", "gptj", "opt", "gpt_neo",
                "qwen2_moe")
IN_PROCESS = FAMILY_NAMES + ("gemma", "gemma2",  # Gemma 1 (no window) and 2 (final soft-cap) in the cheap tests
                              "olmo", "phi3", "stablelm", "starcoder2", "smollm3",  # Llama's layout, other blocks
                              "mixtral", "qwen3_moe", "olmoe")  # ... and mixtures of experts
# four experts, two per token (the defaults are 8-64 experts of width 1408-14336)
MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
       "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=32),
       "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
       "olmoe": dict(num_experts=4, num_experts_per_tok=2)}


# block 0's attention output projection and MLP (whose output the mlp_out site is), where not Llama's names
SITE_MODULES = {"gpt2": ("transformer.h.0.attn.c_proj", "transformer.h.0.mlp"),
                "gpt_neo": ("transformer.h.0.attn.attention.out_proj", "transformer.h.0.mlp"),
                "gptj": ("transformer.h.0.attn.out_proj", "transformer.h.0.mlp"),
                "gpt_neox": ("gpt_neox.layers.0.attention.dense", "gpt_neox.layers.0.mlp"),
                "phi": ("model.layers.0.self_attn.dense", "model.layers.0.mlp"),
                "opt": ("model.decoder.layers.0.self_attn.out_proj", "model.decoder.layers.0.fc2")}


def tiny_config(model_type: str, vocab: int, **kw):
    """A 2-block, width-32 config of this model type; `kw` overrides (e.g. a sliding window)."""
    from transformers import AutoConfig

    common = dict(vocab_size=vocab, initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if model_type == "gpt2":
        args = dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif model_type == "gpt_neo":  # a local layer (window 3: shorter than the test prompts) and a global one
        args = dict(hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=256, window_size=3,
                    attention_types=[[["local", "global"], 1]], embed_dropout=0.0, attention_dropout=0.0,
                    resid_dropout=0.0)
    elif model_type == "opt":
        args = dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
                    max_position_embeddings=256, dropout=0.0, attention_dropout=0.0)
    elif model_type == "gptj":  # rotary on the first 4 of each head's 8 dimensions
        args = dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0)
    else:
        args = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=256)
        if model_type != "gpt_neox":
            args.update(num_key_value_heads=2, head_dim=8)
        args.update(MOE.get(model_type, {}))
    return AutoConfig.for_model(model_type, **{**common, **args, **kw})


def tiny_lm(model_type: str, vocab: int = 64, seed: int = 0, **kw):
    """The model, with a head bias that matters where the head has one (GPT-J, Phi-2: HF starts it at 0, so a
    path that dropped it would pass unseen)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab, **kw)).eval()
    bias = getattr(lm.get_output_embeddings(), "bias", None)
    if bias is not None:
        with torch.no_grad():
            bias.normal_(0, 1.0)
    return lm


def load(path):
    """The suite's loader, wherever it lives (models.loading once moved, training.presets before)."""
    try:
        from models.loading import load_model
    except ImportError:
        from training.presets import load_model
    return load_model(str(path))


def batch():
    from engine.inputs import pad_left

    return pad_left([[5, 9, 2, 7, 3, 11, 4, 8], [6, 1, 12, 3, 10], [7, 7, 2]])  # left-padded, 8 columns


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def saved(request, tmp_path_factory):
    """(model type, folder): a plain HF causal LM saved with save_pretrained beside the task tokenizer."""
    from models.full_bandwidth import save_tokenizer
    from tasks import build_tokenizer

    tok = build_tokenizer()
    path = tmp_path_factory.mktemp(request.param)
    tiny_lm(request.param, len(tok.get_vocab())).save_pretrained(str(path))
    save_tokenizer(tok, path)
    return request.param, path


# ----- the registry ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", IN_PROCESS)
def test_the_adapter_finds_every_part(model_type):
    from models.full_bandwidth import FullBandwidthLM, decoder_layers

    lm = tiny_lm(model_type)
    fam = family_of(lm)
    assert family_of(lm.config) is fam and family_of(lm.config.to_dict()) is fam and model_type in fam.model_types
    assert family_of(FullBandwidthLM(lm, fusion=False)) is fam
    assert decoder_layers(lm) is fam.layers(lm) and len(fam.layers(lm)) == fam.depth(lm.config) == 2
    assert fam.width(lm.config) == 32 and fam.heads(lm.config) == 4 and fam.head_dim(lm.config) == 8
    assert fam.embedding(lm) is lm.get_input_embeddings() and fam.head(lm) is lm.get_output_embeddings()
    assert fam.context(lm.config) == 256 and len(fam.windows(lm.config)) == 2
    names = {m: n for n, m in lm.named_modules()}
    for block in fam.layers(lm):
        attn, mlp, out = fam.attention(block), fam.mlp(block), fam.attn_out(block)
        assert names[attn].endswith(fam.attn_path) and names[mlp].endswith(fam.mlp_path)
        in_features = out.weight.shape[0] if model_type == "gpt2" else out.in_features  # GPT-2: Conv1D [in, out]
        assert in_features == fam.heads(lm.config) * fam.head_dim(lm.config)  # the per-head site: o_proj's input
    assert names[fam.final_norm(lm)].endswith(fam.final_norm_path)
    # the attention output projection and the MLP of block 0 by their full names, written here, not read from the
    # adapter: a wrong path would make the engine's hooks and the references in test_site_patching agree wrongly
    attn_out, mlp = SITE_MODULES.get(model_type, ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp"))
    block0 = fam.layers(lm)[0]
    assert names[fam.attn_out(block0)] == attn_out and names[fam.mlp(block0)] == mlp


def _bloom(vocab: int = 64):
    """BLOOM, a model type no family covers (ALiBi: its positions enter the attention from the 2-D mask)."""
    from transformers import BloomConfig

    return BloomConfig(vocab_size=vocab, hidden_size=32, n_layer=2, n_head=4)


def test_an_unsupported_family_is_refused_in_one_line(tmp_path):
    from transformers import BloomForCausalLM

    from models.full_bandwidth import FullBandwidthLM, save_tokenizer
    from tasks import build_tokenizer

    cfg = _bloom()
    with pytest.raises(UserError) as e:
        family_of(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "'bloom'" in msg and all(f.name in msg for f in FAMILIES)
    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg.vocab_size = len(tok.get_vocab())
    lm = BloomForCausalLM(cfg).eval()
    with pytest.raises(UserError, match="unsupported model family"):
        FullBandwidthLM(lm, fusion=False)
    lm.save_pretrained(str(tmp_path / "neo"))
    save_tokenizer(tok, tmp_path / "neo")
    with pytest.raises(UserError) as e:
        load(tmp_path / "neo")
    assert "\n" not in str(e.value) and "supported are llama" in str(e.value)
    # a model type transformers does not know either: the same line, before HF reads the folder
    (tmp_path / "foo").mkdir()
    (tmp_path / "foo" / "config.json").write_text(json.dumps({"model_type": "foo", "hidden_size": 32}))
    with pytest.raises(UserError) as e:
        load(tmp_path / "foo")
    assert "\n" not in str(e.value) and "model_type 'foo'" in str(e.value) and "supported are llama" in str(e.value)


def test_an_unsupported_family_is_one_line_from_the_cli(tmp_path, capsys):
    from transformers import BloomForCausalLM

    from interventions.run import main
    from models.full_bandwidth import save_tokenizer
    from tasks import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    BloomForCausalLM(_bloom(len(tok.get_vocab()))).save_pretrained(str(tmp_path / "neo"))
    save_tokenizer(tok, tmp_path / "neo")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path / "neo"), "--mode", "standard", "--task", "parity", "--n-pairs", "10",
              "--control-model", "none", "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "unsupported model family" in err and "gpt_neox" in err
    assert not (tmp_path / "o").exists()
    # a config that names no family at all (a custom architecture): the same line, not HF's "Unrecognized model"
    (tmp_path / "neo" / "config.json").write_text('{"architectures": ["MyLM"], "hidden_size": 32}')
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path / "neo"), "--mode", "standard", "--task", "parity", "--n-pairs", "10",
              "--control-model", "none", "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "model_type None" in err and "supported are" in err


# ----- loading, recording, recirculation, the fusion wrapper (in process) -------------------------------------
def test_a_saved_folder_loads_by_path(saved):
    model_type, path = saved
    model, tok, name = load(path)
    assert tok is not None and name == path.name and not model.has_fusion
    assert model.config.model_type == model_type and model.n_layers == 2 and model.d_model == 32
    assert family_of(model) is family_of(model.lm.config)


@pytest.mark.parametrize("model_type", IN_PROCESS)
def test_the_residual_record_is_hf_hidden_states(model_type):
    """Depths 0..L-1 are HF's hidden_states[0..L-1]; depth L is the last block's raw output, whose final norm is
    HF's hidden_states[L]; the logits are HF's (Gemma 2's final soft-cap included). HF is given the engine's
    positions: by default it numbers the columns of a left-padded row from 0 at the padding (GPT-2's learned
    positions would differ; rotary ones only shift)."""
    from engine.prefill import prefill
    from models.full_bandwidth import FullBandwidthLM, positions_from_mask
    from probes.lens import final_norm, lens_logits

    lm = tiny_lm(model_type)
    model = FullBandwidthLM(lm, fusion=False).eval()
    ids, mask = batch()
    T, L, real = ids.shape[1], model.n_layers, mask.bool()
    res = prefill(model, ids, mask, "standard", positions=tuple(range(-T, 0)), collect=True)
    with torch.no_grad():
        hf = lm(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask, T),
                output_hidden_states=True)
        normed = final_norm(lm)(res.resid[:, :, L])
    assert res.resid.shape == (3, T, L + 1, 32)
    for d in range(L):
        assert (res.resid[:, :, d] - hf.hidden_states[d])[real].abs().max() <= 1e-5, d
    assert (normed - hf.hidden_states[L])[real].abs().max() <= 1e-5
    assert (res.logits - hf.logits)[real].abs().max() <= 1e-4
    assert (lens_logits(model, res.resid[:, :, L]) - hf.logits)[real].abs().max() <= 1e-4  # the lens at L: the output


@pytest.mark.parametrize("model_type", IN_PROCESS)
def test_recirculation_on_every_family(model_type):
    """alpha = 0 is the base model (bit for bit through the identity short-circuit, to float rounding through the
    machinery); alpha > 0 changes the output, and blockwise with passes >= T equals the exact sequential run."""
    from engine.prefill import prefill
    from engine.recirculation import RecirculatedLM, parse_recirculate
    from models.full_bandwidth import FullBandwidthLM

    model = FullBandwidthLM(tiny_lm(model_type), fusion=False).eval()
    ids, mask = batch()
    T, real = ids.shape[1], mask.bool()
    std = prefill(model, ids, mask, "standard", positions=tuple(range(-T, 0)), collect=True)
    zero = parse_recirculate("2:1:0", model.n_layers)
    out = RecirculatedLM(model, zero).prefill(ids, mask, collect=True)
    assert torch.equal(out.logits, std.logits) and torch.equal(out.resid, std.resid)
    slow = RecirculatedLM(model, zero, bypass_identity=False).prefill(ids, mask, collect=True)
    assert (slow.logits - std.logits)[real].abs().max() <= 1e-4
    assert (slow.resid - std.resid)[real].abs().max() <= 1e-4
    rlm = RecirculatedLM(model, parse_recirculate("2:1:0.5", model.n_layers))
    seq = rlm.prefill(ids, mask, method="sequential", collect=True)
    assert (seq.logits - std.logits)[real].abs().max() > 1e-3  # it does something
    if model.family.own_causal_bias:  # GPT-Neo: the blockwise pattern would be masked by its own bias (0.13 off)
        with pytest.raises(UserError, match="blockwise recirculation on gpt_neo"):
            rlm.prefill(ids, mask, method="blockwise", passes=T)
        return
    blk = rlm.prefill(ids, mask, method="blockwise", passes=T, collect=True)
    assert (seq.logits - blk.logits)[real].abs().max() <= 1e-4
    assert (seq.resid - blk.resid)[real].abs().max() <= 1e-4


@pytest.mark.parametrize("model_type", IN_PROCESS)
def test_full_bandwidth_wrapper_runs_recurrent_full(model_type):
    """FullBandwidthLM(lm, fusion=True): recurrent-full runs and its logits are finite; the fused input starts at the
    scale of the embedding as the model's embedding module returns it (Gemma's sqrt(width) included)."""
    from engine.prefill import prefill
    from models.full_bandwidth import FullBandwidthLM

    lm = tiny_lm(model_type)
    torch.manual_seed(1)
    model = FullBandwidthLM(lm, fusion=True).eval()
    ids, mask = batch()
    res = prefill(model, ids, mask, "recurrent-full", positions=(-2, -1), collect=True)
    assert torch.isfinite(res.logits).all() and torch.isfinite(res.resid).all()
    assert res.resid.shape == (3, 2, 3, 32)
    with torch.no_grad():
        emb = lm.get_input_embeddings()(torch.arange(64))
    assert float(model.fusion.norm.weight[0].detach()) == pytest.approx(float(emb.pow(2).mean().sqrt()), rel=1e-4)


# ----- sliding windows under a custom 4-D mask ----------------------------------------------------------------
WINDOWED = [("gemma3_text", dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"])),
            ("mistral", dict(sliding_window=3)), ("qwen3", dict(sliding_window=3, use_sliding_window=True,
                                                                max_window_layers=0, layer_types=None)),
            ("phi3", dict(sliding_window=3)), ("starcoder2", dict(sliding_window=3)),
            ("smollm3", dict(sliding_window=3, use_sliding_window=True,
                             layer_types=["sliding_attention", "full_attention"])),
            ("mixtral", dict(sliding_window=3)), ("qwen3_moe", dict(sliding_window=3, use_sliding_window=True)),
            ("qwen2_moe", dict(sliding_window=3, use_sliding_window=True, max_window_layers=2, layer_types=None))]


@pytest.mark.parametrize("model_type, kw", WINDOWED)
def test_custom_masks_keep_each_layers_window(model_type, kw):
    """HF uses a 4-D mask as given, in every layer: Family.attention_masks applies each layer's window to a custom
    pattern, so the causal pattern through it is HF's own windowed forward."""
    from models.full_bandwidth import positions_from_mask

    def _float_mask(allowed, dtype):  # one mask for every layer: the window lost
        m = torch.zeros(allowed.shape, dtype=dtype)
        m.masked_fill_(~allowed, torch.finfo(dtype).min)
        return m[:, None]

    lm = tiny_lm(model_type, **kw)
    fam = family_of(lm)
    assert any(w == 3 for w in fam.windows(lm.config))
    ids, mask = batch()
    T = ids.shape[1]
    pos = positions_from_mask(mask, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :]
    with torch.no_grad():
        ref = lm.base_model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        masks = fam.attention_masks(lm.config, causal, torch.arange(T), torch.arange(T), torch.float32)
        got = lm.base_model(input_ids=ids, attention_mask=masks, position_ids=pos).last_hidden_state
        blind = lm.base_model(input_ids=ids, attention_mask=_float_mask(causal, torch.float32),
                              position_ids=pos).last_hidden_state
    real = mask.bool()
    assert (got - ref)[real].abs().max() <= 1e-5
    assert (blind - ref)[real].abs().max() > 1e-3  # without the window the model is another one


@pytest.mark.parametrize("model_type, kw", WINDOWED[:2])
def test_recirculation_keeps_sliding_windows(model_type, kw):
    from engine.recirculation import RecirculatedLM, parse_recirculate
    from models.full_bandwidth import FullBandwidthLM

    model = FullBandwidthLM(tiny_lm(model_type, **kw), fusion=False).eval()
    ids, mask = batch()
    zero = parse_recirculate("2:1:0", 2)
    base = RecirculatedLM(model, zero).prefill(ids, mask)
    for method in ("sequential", "blockwise"):
        slow = RecirculatedLM(model, zero, bypass_identity=False).prefill(ids, mask, method=method, passes=1)
        assert (slow.logits - base.logits)[mask.bool()].abs().max() <= 1e-4, method


@pytest.mark.parametrize("model_type", ["llama", "gemma", "gpt2", "gpt_neox", "olmo", "olmo2", "stablelm", "phi",
                                        "olmoe", "gptj", "opt"])
def test_a_window_the_model_ignores_is_no_window(model_type):
    """Llama, Gemma 1, GPT-2 and GPT-NeoX attend fully whatever `sliding_window` / `layer_types` their config holds
    (HF's base model never reads them): the engine must not window them either. Recirculation at alpha 0 through
    its custom 4-D masks, the identity short-circuit off, is then the standard pass (a window applied would move
    it by ~1 logit on this model: a query 7 columns on sees 3)."""
    from engine.cache import model_windows
    from engine.recirculation import RecirculatedLM, parse_recirculate
    from models.full_bandwidth import FullBandwidthLM, positions_from_mask

    lm = tiny_lm(model_type)
    lm.config.sliding_window = 3  # what a stray key in config.json gives
    lm.config.layer_types = ["sliding_attention"] * 2
    model = FullBandwidthLM(lm, fusion=False).eval()
    assert family_of(lm).windows(lm.config) == [None, None] and model_windows(model) == [None, None]
    ids, mask = batch()
    with torch.no_grad():
        ref = lm(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask, ids.shape[1])).logits
    zero = parse_recirculate("2:1:0", 2)
    base = RecirculatedLM(model, zero).prefill(ids, mask)
    slow = RecirculatedLM(model, zero, bypass_identity=False).prefill(ids, mask, method="sequential", passes=1)
    real = mask.bool()
    assert (slow.logits - base.logits)[real].abs().max() <= 1e-4
    assert (base.logits[:, -1] - ref[:, -1]).abs().max() <= 1e-4


# ----- the command lines, on the saved folder by path ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["standard", "recirc-2:1:0.5"])
def test_interventions_run_by_path(saved, tmp_path, mode):
    from interventions.run import main

    model_type, path = saved
    out = tmp_path / "o"
    assert main(["--task", "parity", "--model", str(path), "--mode", mode, "--n-pairs", "10",
                 "--distractors", "3", "--max-positions", "2" if mode != "standard" else "0",
                 "--control-model", "none", "--out", str(out), "--no-progress"]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    assert rep["model"]["n_layers"] == 2
    if mode == "standard":
        assert rep["verdict"]["label"] == "not applicable (no feedback)"
        lp = rep["results"]["layer_patching"]["standard"]
        # The top residual at T patched is the donor's run: normalized effect 1 up to the float rounding of the LDs
        # (~1e-6 in float32) over its denominator, which a random tiny model makes small (~5e-4 here): the
        # tolerance is that rounding's share of it (a cell with effect 0 holds the clean LD).
        clean_ld = next(ld for ne_row, ld_row in zip(lp["normalized_effect"], lp["ld_mean"])
                        for ne, ld in zip(ne_row, ld_row) if ne == 0.0)
        denom = abs(lp["ld_mean"][-1][-1] - clean_ld)
        assert lp["normalized_effect"][-1][-1] == pytest.approx(1.0, abs=max(1e-4, 2e-6 / denom)), model_type
    else:  # the recirculated state is a fed state: the battery runs on it
        assert rep["results"]["interventions"] and rep["results"]["dose"] is not None, model_type


def test_evaluate_by_path(saved, tmp_path):
    from analysis.evaluate import main

    model_type, path = saved
    out = tmp_path / "eval.json"
    main(["--model", str(path), "--tasks", "completion", "--distractors", "0", "--modes", "standard,recirc-2:1:0.5",
          "--n-pairs", "5", "--out", str(out), "--no-progress"])
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [r["mode"] for r in rows] == ["standard", "recirc-2:1:0.5:convex"], model_type
    assert all(r["n_samples"] == 10 and 0 <= r["accuracy"] <= 1 for r in rows)
    from models.fingerprint import config_hash, weights_hash
    from models.loading import load_model

    model = load_model(str(path))[0]  # the file names the tensors and config that answered
    assert (doc["meta"]["weights_sha256"], doc["meta"]["config_sha256"]) == (weights_hash(model), config_hash(model))


def test_probes_run_by_path(saved, tmp_path):
    """Standard and a recirculated mode: the normal branch equals standard up to the target depth."""
    import numpy as np

    from probes.run import main

    model_type, path = saved
    out = tmp_path / "p"
    assert main(["--task", "completion", "--model", str(path), "--out", str(out), "--recirculate", "2:1:0.5",
                 "--n-pairs", "10", "--distractors", "0", "--n-boot", "20", "--no-progress", "--no-cache",
                 "--save-activations"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert {r["mode"] for r in doc["results"]} == {"standard", "recirc-2:1:0.5:convex"}
    std = np.load(out / "activations" / "N0_standard.npz")["resid"]
    rec = np.load(out / "activations" / "N0_recirc-2:1:0.5:convex.npz")["resid"]
    assert std.shape[1:] == (3, 32) and np.abs(std[:, :2] - rec[:, :2]).max() <= 1e-5, model_type


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_recirculated_generation_is_held_to_the_context_as_every_decoding(model_type):
    """generate under recirc-S:D:A checked the prompt alone: GPT-2 ran its whole prefill and died on a position
    embedding (IndexError), Llama generated past its context. One line now, as std; the count must be an integer."""
    from common.errors import UserError
    from engine.prefill import generate
    from models.full_bandwidth import FullBandwidthLM

    model = FullBandwidthLM(tiny_lm(model_type), fusion=False).eval()
    ids = torch.tensor([[(i % 60) + 1 for i in range(250)]])
    mask = torch.ones_like(ids)
    for decoding in ("std", "recirc-2:1:0.5"):
        with pytest.raises(UserError, match="250 prompt tokens \\+ 10 new tokens exceed the model's context"):
            generate(model, ids, mask, 10, decoding)
        assert generate(model, ids, mask, 7, decoding).shape == (1, 7)  # the last new token is never fed back
        for bad in (True, 2.0, -1):
            with pytest.raises(UserError, match="max_new_tokens must be an integer >= 0"):
                generate(model, ids[:, :5], mask[:, :5], bad, decoding)


def test_a_token_id_outside_the_vocabulary_is_one_line():
    from common.errors import UserError
    from engine.prefill import generate, prefill
    from models.full_bandwidth import FullBandwidthLM

    model = FullBandwidthLM(tiny_lm("llama"), fusion=False).eval()
    for bad in (64, -1):
        ids = torch.tensor([[1, 2, bad, 3]])
        with pytest.raises(UserError, match="outside the model's vocabulary 0..63"):
            prefill(model, ids, torch.ones_like(ids), "standard")
        with pytest.raises(UserError, match="outside the model's vocabulary"):
            generate(model, ids, torch.ones_like(ids), 2, "recirc-2:1:0.5")


@pytest.mark.parametrize("model_type", IN_PROCESS)
def test_recurrent_full_equals_the_uncached_recompute(model_type):
    """The cached recurrence (models.lean_step, or HF's own one-token step where the family has none) against a
    full forward of every prefix without a cache, fed the top states the recurrence computed: the same top state at
    every position, on a left-padded batch."""
    from engine.prefill import prefill
    from models.full_bandwidth import FullBandwidthLM

    torch.manual_seed(2)
    model = FullBandwidthLM(tiny_lm(model_type), fusion=True).eval()
    with torch.no_grad():  # a fusion that matters: random, not the identity-like init
        model.fusion.up.weight.normal_(0, 0.3)
        model.fusion.gate.weight.normal_(0, 0.3)
    ids, mask = batch()
    T = ids.shape[1]
    res = prefill(model, ids, mask, "recurrent-full", positions=tuple(range(-T, 0)), collect=False)
    state = torch.zeros_like(res.top)
    state[:, 1:] = res.top[:, :-1]
    first = (mask == 0).sum(1)  # each row's first real column is never fused
    fuse = (torch.arange(T)[None] > first[:, None]) & mask.bool()
    real = mask.bool()
    with torch.no_grad():
        for t in range(T):
            top = model(ids[:, :t + 1], mask[:, :t + 1], state=state[:, :t + 1], fuse_mask=fuse[:, :t + 1]).top[:, -1]
            assert (top - res.top[:, t])[real[:, t]].abs().max() <= 1e-4, t
        std = prefill(model, ids, mask, "standard", positions=(-1,), collect=False)
    assert (std.logits[:, -1] - res.logits[:, -1]).abs().max() > 1e-3  # the feedback does something


def test_the_chunked_standard_pass_keeps_a_longrope_models_frequencies(monkeypatch):
    """Phi-3 windows every layer, so analysis.evaluate's chunked standard pass would take it; LongRoPE picks its
    frequencies by the sequence length of each call, so chunks past the original context computed another model
    (4.6 logits off HF on this one). Only relative rotary types are chunked: the pass is HF's."""
    import engine.prefill as P
    from models.full_bandwidth import FullBandwidthLM, positions_from_mask

    lm = tiny_lm("phi3", num_hidden_layers=2, sliding_window=5, max_position_embeddings=128,
                 original_max_position_embeddings=8,
                 rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(4)],
                                   long_factor=[2.0 + 0.5 * i for i in range(4)], original_max_position_embeddings=8))
    model = FullBandwidthLM(lm, fusion=False).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    monkeypatch.setattr(P, "STANDARD_CHUNK", 4)  # a 12-token prompt takes the chunked path
    with torch.no_grad():
        got = P.prefill_many(model, ids, mask, ["standard"], positions=(-1,), collect=False, chunked=True)
        hf = lm(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask, 12)).logits[:, -1]
    assert (got["standard"].logits[:, 0] - hf).abs().max() <= 1e-4


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_recurrent_full_beside_other_recurrent_modes_on_a_padded_batch(model_type):
    """CausalContext checks its clean runs against the engine's bit for bit; with recurrent-full prepared beside
    another recurrent mode the engine skips a padding column's state the runner computes, and the check refused a
    valid batch. Only real columns are compared (padding states are never read)."""
    import numpy as np

    from interventions.batch import Batch
    from interventions.core import CausalContext
    from models.full_bandwidth import FullBandwidthLM

    torch.manual_seed(2)
    model = FullBandwidthLM(tiny_lm(model_type), fusion=True).eval()
    ids, mask = batch()
    ids = torch.cat([ids, ids[:1]])
    mask = torch.cat([mask, mask[:1]])
    b = Batch(ids, mask, torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]), np.arange(4), (5, 6))
    for modes in (("standard", "recurrent-1", "recurrent-full"), ("standard", "recurrent-3", "recurrent-full")):
        ctx = CausalContext(model, b, modes=modes)
        assert set(ctx.runners) >= set(modes[1:])


def test_stepwise_runs_across_a_longrope_models_original_context_are_refused():
    """LongRoPE picks its frequencies by each call's length (the long factors once a call passes the original
    context): a run whose first call lies within it and a later column past it mixes two models (recirculation at
    alpha 0, identity short-circuit off, was 4.5 logits off HF at T = 9 here; greedy decoding crossing it differs
    from HF's generate, which recomputes without its cache there). Refused in one line; a run whose every call lies
    past it (recurrent-k with T - k >= the original context) or within it runs, and equals the uncached recompute."""
    from common.errors import UserError
    from engine.prefill import generate, prefill
    from engine.recirculation import RecirculatedLM, parse_recirculate
    from models.full_bandwidth import FullBandwidthLM

    lm = tiny_lm("phi3", num_hidden_layers=2, max_position_embeddings=128, original_max_position_embeddings=8,
                 rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(4)],
                                   long_factor=[2.0 + 0.5 * i for i in range(4)], original_max_position_embeddings=8))
    torch.manual_seed(1)
    model = FullBandwidthLM(lm, fusion=True).eval()
    with torch.no_grad():
        model.fusion.up.weight.normal_(0, 0.3)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    prefill(model, ids, mask, "standard")
    for mode in ("recurrent-full", "recurrent-5", "recirc-2:1:0.5"):  # first calls of 1, 8 and 1 columns
        with pytest.raises(UserError, match="longrope rotary embeddings: its first call covers .* original context "
                                             "\\(8\\)"):
            prefill(model, ids, mask, mode)
    with pytest.raises(UserError, match="recirculation on a model with longrope"):
        RecirculatedLM(FullBandwidthLM(lm, fusion=False), parse_recirculate("2:1:0.5", 2)).prefill(ids, mask)
    with pytest.raises(UserError, match="its first call covers 1 of 12 columns"):  # k past the prompt: as full
        prefill(model, ids, mask, "recurrent-100000")
    from engine.modes import parse_mode
    from engine.patching import patcher

    for mode in ("recurrent-full", "recirc-2:1:0.5"):  # the patched runs too, whoever builds them (no engine check)
        with pytest.raises(UserError, match="on a model with longrope"):
            patcher(parse_mode(mode, 2), model, ids, mask)
    # recurrent-4: the first call covers 9 columns, past the original context like every step: one model
    res = prefill(model, ids, mask, "recurrent-4", positions=tuple(range(-12, 0)), collect=False)
    state = torch.zeros_like(res.top)
    state[:, 1:] = res.top[:, :-1]
    fuse = torch.zeros_like(mask, dtype=torch.bool)
    fuse[:, -4:] = True
    with torch.no_grad():
        for t in range(8, 12):
            top = model(ids[:, :t + 1], mask[:, :t + 1], state=state[:, :t + 1], fuse_mask=fuse[:, :t + 1]).top[:, -1]
            assert (top - res.top[:, t]).abs().max() <= 1e-4, t
    # within the original context everything runs; generation may not cross it
    short, smask = ids[:, :6], mask[:, :6]
    for mode in ("recurrent-full", "recirc-2:1:0.5"):
        prefill(model, short, smask, mode)
    generate(model, short, smask, 3, "std")  # 6 + 2 fed back = 8 columns
    for decoding in ("std", "soft", "recirc-2:1:0.5"):
        with pytest.raises(UserError, match="generation on a model with longrope"):
            generate(model, short, smask, 4, decoding)


def test_a_batch_across_a_longrope_models_original_context_is_refused():
    """HF's LongRoPE picks one set of frequencies per call, by the batch's longest row: a 5-token row batched with a
    12-token one (original context 8) took the long factors it would not take alone (0.27 logits off its own run).
    Refused in one line; rows on one side of the original context batch as they run alone."""
    from common.errors import UserError
    from engine.inputs import pad_left
    from engine.prefill import generate, prefill
    from models.full_bandwidth import FullBandwidthLM

    lm = tiny_lm("phi3", num_hidden_layers=2, max_position_embeddings=128, original_max_position_embeddings=8,
                 rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(4)],
                                   long_factor=[2.0 + 0.5 * i for i in range(4)], original_max_position_embeddings=8))
    model = FullBandwidthLM(lm, fusion=False).eval()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (12, 5, 10, 8)]
    ids, mask = pad_left([rows[0], rows[1]])
    for run in (lambda: prefill(model, ids, mask, "standard"), lambda: generate(model, ids, mask, 1, "std")):
        with pytest.raises(UserError, match=r"prompts of 5 to 12 tokens .* longrope .* original context \(8\)"):
            run()
    for pair in ((rows[0], rows[2]), (rows[1], rows[3])):  # both past it; both within it
        ids, mask = pad_left(list(pair))
        both = prefill(model, ids, mask, "standard").logits[:, -1]
        for i, r in enumerate(pair):
            alone = prefill(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long), "standard").logits
            assert (both[i] - alone[0, -1]).abs().max() <= 1e-4


def test_a_longrope_kept_per_layer_type_is_refused_too():
    """transformers 5 keeps Gemma 3's rotary settings per layer type ({"full_attention": {...}, "sliding_attention":
    {...}}): a LongRoPE there picks its frequencies by each call's length as well. Read at the top level only, the
    model passed for a default rotary one and recirculation at alpha 0 (short-circuit off) ran 0.17 logits off HF.
    Nested or flat, and which types count, as HF decides."""
    from common.errors import UserError
    from engine.inputs import _rope_types, check_stepwise, context_length
    from engine.recirculation import RecirculatedLM, parse_recirculate
    from models.full_bandwidth import FullBandwidthLM

    longrope = dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0 + 0.1 * i for i in range(4)],
                    long_factor=[2.0 + 0.5 * i for i in range(4)], original_max_position_embeddings=8)
    lm = tiny_lm("gemma3_text", max_position_embeddings=128, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention"],
                 rope_parameters={"full_attention": longrope,
                                  "sliding_attention": dict(rope_type="default", rope_theta=1e4)})
    assert _rope_types(lm.config) == {"longrope", "default"}
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    for rope in (lm.config.rope_parameters,  # and beside a top-level type, which HF ignores once nested (0.13 off)
                 {"rope_type": "default", **lm.config.rope_parameters}):
        lm.config.rope_parameters = rope
        model = FullBandwidthLM(lm, fusion=False).eval()
        with pytest.raises(UserError, match="longrope rotary embeddings: its first call covers 1 of 12 .* \\(8\\)"):
            RecirculatedLM(model, parse_recirculate("2:1:0", 2), bypass_identity=False).prefill(ids, torch.ones_like(ids))
    # two layer types, two original contexts: a first call of 13 columns straddles the larger one (the sliding
    # layers switch factors between calls: 0.31 off the uncached recompute when only the smaller was checked)
    lm.config.rope_parameters = {"full_attention": longrope, "sliding_attention": {
        **longrope, "original_max_position_embeddings": 16}}
    ids20 = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(UserError, match="first call covers 13 of 20 columns, across its original context \\(16\\)"):
        check_stepwise(FullBandwidthLM(lm, fusion=False), torch.ones_like(ids20), "recurrent-8", steps=8)
    # a model type that reads its rotary flat (Qwen 2) ignores a stray per-type key: its LongRoPE is refused still
    # (read as nested, the key hid it: recirculation ran 2.5 logits off HF)
    qwen = tiny_config("qwen2", 64, max_position_embeddings=128, layer_types=["full_attention"] * 2,
                       rope_parameters={**longrope, "full_attention": dict(rope_type="default", rope_theta=1e4)})
    assert _rope_types(qwen) == {"longrope"}
    # a flat LongRoPE given to Gemma 3 is ignored by HF (it nests defaults beside it): the model runs
    flat = tiny_lm("gemma3_text", max_position_embeddings=128, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(longrope))
    assert _rope_types(flat.config) == {"default"}
    RecirculatedLM(FullBandwidthLM(flat, fusion=False).eval(), parse_recirculate("2:1:0", 2),
                   bypass_identity=False).prefill(ids, torch.ones_like(ids))
    # every layer windowed: unbounded only where the rotary of every layer type in use is relative (HF builds no
    # rotary for a type no layer has: a LongRoPE there changes nothing)
    for sliding, unbounded in ((longrope, False), (dict(rope_type="linear", factor=2.0, rope_theta=1e4), True)):
        cfg = tiny_config("gemma3_text", 64, sliding_window=4, layer_types=["sliding_attention"] * 2,
                          rope_parameters={"full_attention": longrope, "sliding_attention": sliding})
        assert (context_length(cfg, [4, 4]) is None) is unbounded


@pytest.mark.parametrize("model_type, edit, needle", [
    ("qwen2_moe", dict(num_experts_per_tok=5), "num_experts_per_tok must be an integer in 1..4"),
    ("olmoe", dict(num_experts_per_tok=0), "num_experts_per_tok must be an integer in 1..4"),
    ("mixtral", dict(num_local_experts=0), "num_local_experts must be a positive integer"),
    ("qwen2_moe", dict(moe_intermediate_size=0), "moe_intermediate_size must be a positive integer"),
    # HF still types layers 0 and 2 sliding, and its mask code fails without a window
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=None, max_window_layers=2,
                       layer_types=["sliding_attention", "full_attention"]), "but no sliding_window"),
    # no layer slides, but Gemma 2 / 3 and Qwen2-MoE build the sliding mask anyway: HF's own forward fails
    ("gemma2", dict(sliding_window=None, layer_types=["full_attention"] * 2), "HF's own forward fails"),
    ("gemma3_text", dict(sliding_window=None, layer_types=["full_attention"] * 2), "HF's own forward fails")])
def test_a_config_hf_cannot_run_is_one_line(tmp_path, model_type, edit, needle):
    """torch.topk's traceback at the first forward (more experts per token than experts, or none), or HF's mask
    code's: refused at loading in one line."""
    tiny_lm(model_type).save_pretrained(str(tmp_path / "m"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(UserError, match=needle) as e:
        load(tmp_path / "m")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", ["mixtral", "llama"])
def test_bfloat16_padded_passes_keep_hfs_kernel(model_type):
    """In bfloat16 the standard pass of a padded batch runs HF's default SDPA, as recirculation's 4-D-mask passes do:
    with eager there (the float32 CPU speed path) the two rounded a bf16 step apart, and on a tiny Mixtral that
    flipped one routing choice: 1.27 logits between the standard pass and recirculation at alpha 0."""
    from engine.prefill import prefill
    from engine.recirculation import RecirculatedLM, parse_recirculate
    from models.full_bandwidth import FullBandwidthLM, positions_from_mask

    lm = tiny_lm(model_type).to(torch.bfloat16)
    model = FullBandwidthLM(lm, fusion=False).eval()
    ids, mask = batch()
    std = prefill(model, ids, mask, "standard", positions=(-1,)).logits[:, 0].float()
    rec = RecirculatedLM(model, parse_recirculate("2:1:0", 2), bypass_identity=False).prefill(ids, mask)
    with torch.no_grad():
        hf = lm(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask, ids.shape[1])).logits
    assert (std - hf[:, -1].float()).abs().max() <= 1e-6
    # the machinery (bypass_identity=False) matches "to float rounding": bit for bit on the machines this test
    # was first run on, one bf16 step (0.0156 at logits ~4) in the last block on an AVX2 EPYC; the routing flip this
    # guards against moved 1.27 logits
    assert (rec.logits[:, -1].float() - std).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * std.abs().max()


def test_loading_runs_a_one_position_model(tmp_path):
    """The load-time forward (models.full_bandwidth.check_runs) fits the model's context: a GPT-2 of 1 position
    loads (a 2-token check asked for a position it has not: refused)."""
    tiny_lm("gpt2", n_positions=1).save_pretrained(str(tmp_path / "m"))
    model = load(tmp_path / "m")[0]
    assert model.config.n_positions == 1


@pytest.mark.parametrize("edit, needle", [
    (dict(word_embed_proj_dim=16), "token embeddings are 16 wide and its residual stream 32"),
    (dict(do_layer_norm_before=False), "finds no final norm at `decoder.final_layer_norm`")])
def test_an_opt_shape_the_engine_cannot_read_is_one_line(edit, needle):
    """OPT-350m projects between its 512-wide embeddings and its 1024-wide residual stream and, post-LN, has no
    final norm: depth 0, the fused input and the lens would not be the model's. Refused in one line."""
    from models.full_bandwidth import FullBandwidthLM

    with pytest.raises(UserError, match=needle) as e:
        FullBandwidthLM(tiny_lm("opt", **edit), fusion=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", ["gpt2", "gptj", "gpt_neox", "opt", "stablelm"])
def test_a_head_dim_the_model_ignores_is_ignored(model_type):
    """These attentions split the width by the heads whatever `head_dim` says: a stray key must not move the
    per-head site (it took head 1 of GPT-J as columns 16..31 of a 32-wide head 0)."""
    lm = tiny_lm(model_type, head_dim=16)
    fam = family_of(lm)
    assert fam.head_dim(lm.config) == 8
    llama = tiny_config("llama", 64, head_dim=16)  # Llama reads it: 4 heads of 16 on a width of 32
    assert family_of(llama).head_dim(llama) == 16
    from models.configs import check_config

    check_config(tiny_config(model_type, 64, head_dim=0), "x")  # nor is such a key checked (HF runs the model)
    with pytest.raises(UserError, match="head_dim must be a positive integer"):
        check_config(tiny_config("llama", 64, head_dim=0), "x")


def test_the_recirculation_study_refuses_gpt_neo_before_any_work(tmp_path, capsys):
    """Its cost section (e) runs blockwise recirculation, refused on GPT-Neo: the study says so after loading, not
    minutes in."""
    from analysis.recirculation.cli import main
    from models.full_bandwidth import save_tokenizer
    from tasks import build_tokenizer

    tok = build_tokenizer()
    tiny_lm("gpt_neo", len(tok.get_vocab())).save_pretrained(str(tmp_path / "neo"))
    save_tokenizer(tok, tmp_path / "neo")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path / "neo"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "cost section (e) runs blockwise recirculation" in err and err.count("\n") == 0
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("model_type", [["llama"], {"llama": 1}])
def test_a_model_type_that_is_no_string_is_one_line(tmp_path, model_type):
    """A list or dict model_type is unhashable: the unsupported-family line, not a TypeError traceback."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 32}))
    with pytest.raises(UserError, match="unsupported model family") as e:
        load(tmp_path / "m")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="unsupported model family"):
        family_of({"model_type": model_type})


@pytest.mark.parametrize("key", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_a_soft_cap_of_zero_is_refused(key):
    """HF computes tanh(x / 0) * 0 = 0 for a cap of 0 (a blind model) where `if cap:` took it for no cap: the engine
    then ran another model than HF's. Such a config is refused; null turns the cap off."""
    from models.configs import check_config
    from models.full_bandwidth import FullBandwidthLM

    for bad in (0.0, -3.0, float("inf")):
        with pytest.raises(UserError, match=f"{key} must be a finite number > 0 or null"):
            check_config(tiny_config("gemma2", 64, **{key: bad}), "x")
    check_config(tiny_config("gemma2", 64, **{key: None}), "x")
    lm = tiny_lm("gemma2", **{key: 2.5})
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        ref = lm(input_ids=ids).logits
        got = FullBandwidthLM(lm, fusion=False)(ids, torch.ones_like(ids)).logits
    assert (got - ref).abs().max() < 1e-5


@pytest.mark.parametrize("model_type", IN_PROCESS)
def test_the_block_sites_are_what_the_block_adds(model_type):
    """resid_{l+1} = resid_l + attn_out + mlp_out at every block (TransformerLens' hook_attn_out / hook_mlp_out: "that
    which is added to the residual stream"). In sandwich-norm models (Gemma 2 / 3, OLMo 2) that is the output of the
    norm after each branch, not the branch's own output (off by 1.7-3.7 here before)."""
    from engine.hooks import on_block

    lm = tiny_lm(model_type, seed=1)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    got, handles = {}, []
    for layer in range(len(family_of(lm).layers(lm))):
        for site in ("attn_out", "mlp_out"):
            handles.append(on_block(lm, layer, site, lambda x, k=(layer, site): got.__setitem__(k, x.detach().clone())))
    try:
        with torch.no_grad():
            hs = lm(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        for h in handles:
            h.remove()
    for layer in range(len(hs) - 2):  # the last hidden state is after the final norm
        update = got[(layer, "attn_out")] + got[(layer, "mlp_out")]
        assert (hs[layer + 1] - hs[layer] - update).abs().max() < 1e-4, layer


def test_a_stray_soft_cap_key_is_read_where_hf_reads_it_only():
    """Gemma 1 and Llama never read final_logit_softcapping: a stray key is neither refused nor applied (HF's
    logits); Gemma 2 applies it."""
    from models.configs import check_config
    from models.full_bandwidth import FullBandwidthLM

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    for model_type in ("gemma", "llama"):
        check_config(tiny_config(model_type, 64, final_logit_softcapping=0.0), "x")
        lm = tiny_lm(model_type, final_logit_softcapping=0.5)
        with torch.no_grad():
            ref, got = lm(input_ids=ids).logits, FullBandwidthLM(lm, fusion=False)(ids, torch.ones_like(ids)).logits
        assert (got - ref).abs().max() < 1e-5 and ref.abs().max() > 0.5, model_type
